"""Scripts share nothing, so what several scripts need is pasted into each. The LM scripts end with one
plumbing block, the RL scripts with another, each below a banner; these tests keep each block the same
text, byte for byte, in every script of its family, and a helper above the banner that two scripts both
define the same text in both."""
import importlib
import inspect
import os

import pytest

import dpo
import grpo
import ppo_clip
import ppo_continuous
import ppo_kl
import reward_model
import rlhf_ppo
import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_SCRIPTS = [ppo_clip, ppo_kl, ppo_continuous]
LM_SCRIPTS = [sft, reward_model, dpo, rlhf_ppo, grpo]
BANNER = "# Plumbing. Everything below this line is the same text in "

# Above the banner, the same name is the same text too, except for what is each script's own: its Args, Agent,
# argument checks (the LM scripts'), evaluation and main.
RL_SHARED = ["compute_gae", "clipped_policy_loss", "categorical_kl", "value_loss", "layer_init", "mlp", "check_args"]
LM_SHARED = ["kl_estimators", "completion_text", "last_boxed", "answer_number", "gold", "exact_match", "numeric_match",
             "format_match", "combine_rewards"]
REWARDS = "# Rewards as plain Python functions"
# each script's own (act: the policy's step, Gaussian in ppo_continuous.py)
OWN = {"rl": {"Args", "Agent", "act", "evaluate", "main"}, "lm": {"Args", "evaluate", "main", "check_args"}}


def below_banner(text):
    """The plumbing block: the text from the banner's first line to the end of the file."""
    start = text.index(BANNER)
    return text[text.rindex("\n# ====", 0, start) + 1 :]


def read(script):
    with open(os.path.join(ROOT, f"{script.__name__}.py"), encoding="utf-8") as f:
        return f.read()


def differing_blocks(texts):
    """The names of the scripts whose block differs from the first script's, and that block's line count."""
    blocks = {name: below_banner(text) for name, text in texts.items()}
    first = next(iter(blocks.values()))
    return [name for name, block in blocks.items() if block != first], first.count("\n")


@pytest.mark.parametrize("family", ["rl", "lm"])
def test_the_block_below_the_banner_is_identical(family):
    scripts = RL_SCRIPTS if family == "rl" else LM_SCRIPTS
    differing, lines = differing_blocks({s.__name__: read(s) for s in scripts})
    assert differing == [] and lines > (40 if family == "rl" else 400)


def test_one_character_changed_below_the_banner_in_any_script_is_caught():
    texts = {s.__name__: read(s) for s in LM_SCRIPTS + RL_SCRIPTS}
    for family in (RL_SCRIPTS, LM_SCRIPTS):
        for script in family:
            changed = {s.__name__: texts[s.__name__] for s in family}
            text = changed[script.__name__]
            at = text.index("def save_") + 4  # one character of a function name, deep in the block
            changed[script.__name__] = text[:at] + text[at].upper() + text[at + 1 :]
            assert differing_blocks(changed)[0] != [], script.__name__


def above_banner_names(script):
    """Functions and classes a script defines above its banner."""
    block = below_banner(read(script))
    return {name for name, obj in vars(script).items()
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == script.__name__
            and f"\ndef {name}(" not in block and f"\nclass {name}" not in block}


@pytest.mark.parametrize("family", ["rl", "lm"])
def test_a_name_above_the_banner_in_two_scripts_is_one_text(family):
    scripts, listed = (RL_SCRIPTS, RL_SHARED) if family == "rl" else (LM_SCRIPTS, LM_SHARED)
    where = {}
    for script in scripts:
        for name in above_banner_names(script):
            where.setdefault(name, []).append(script)
    shared = {name for name, found in where.items() if len(found) >= 2}
    assert shared - OWN[family] == set(listed)
    for name in listed:
        copies = {s.__name__: inspect.getsource(getattr(s, name)) for s in where[name]}
        assert len(set(copies.values())) == 1, copies.keys()


def rewards_section(text):
    """grpo.py's and rlhf_ppo.py's reward functions: from their section's first line to the argument checks."""
    return text[text.rindex("\n# ----", 0, text.index(REWARDS)) + 1 : text.index("\ndef check_args(")]


def test_the_reward_functions_are_one_text_in_grpo_and_rlhf_ppo():
    sections = [rewards_section(read(script)) for script in (grpo, rlhf_ppo)]
    assert sections[0] == sections[1] and "BUILTIN_REWARDS = {" in sections[0] and sections[0].count("\ndef ") == 8


def test_no_script_imports_another():
    for script in RL_SCRIPTS + LM_SCRIPTS:
        source = read(script)
        for other in RL_SCRIPTS + LM_SCRIPTS:
            assert f"import {other.__name__}\n" not in source and f"from {other.__name__} " not in source


# ------------------------------------------------------------------------- the built-in sort task
def task_data(module, seed):
    rng = module.task_rng(seed, "train")
    data = []
    for _ in range(200):
        prompt, target = module.make_prompt(rng)
        data.append((prompt, target, module.demonstration(rng, target), module.candidate(rng, target)))
    data += [module.preference_pair(rng) for _ in range(200)]
    return data


def test_the_task_depends_on_the_seed_and_its_splits_differ():
    assert task_data(sft, 7) == task_data(importlib.import_module("grpo"), 7)
    assert task_data(sft, 7) != task_data(sft, 8)
    assert sft.task_rows(7, "train", 5, "prompt") != sft.task_rows(7, "eval", 5, "prompt")
