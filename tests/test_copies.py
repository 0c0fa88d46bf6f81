"""Scripts share nothing, so a helper several scripts need is pasted into each: one canonical text
under one name. These tests keep the copies identical, and the copies of the built-in task
making the same data."""
import importlib
import inspect

import pytest

import dpo
import grpo
import ppo_clip
import ppo_continuous
import ppo_kl
import reward_model
import rlhf_ppo
import sft

RL_SCRIPTS = [ppo_clip, ppo_kl, ppo_continuous]
LM_SCRIPTS = [sft, reward_model, rlhf_ppo, dpo, grpo]

# Same job, same text. Not in these lists on purpose: each script's Args, Agent, evaluate and main,
# whose differences are the point of the script (ppo_continuous.py's evaluate normalizes observations
# and clips actions; ppo_kl.py's Agent also returns the logits).
RL_SHARED = ["compute_gae", "clipped_policy_loss", "categorical_kl", "value_loss", "layer_init", "check_args", "make_envs", "check_env",
             "save_checkpoint", "load_checkpoint"]
LM_SHARED = ["render_chat", "encode_prompt", "stop_token_ids", "tokenize_pair", "add_pad_token", "tokenize_preference",
             "load_rows", "load_tokenizer", "dropout_off", "get_lr", "check_finite", "save_atomically", "collate",
             "sample", "decode", "token_logprobs", "position_ids_of", "last_token_index", "token_scores",
             "score_responses", "TokenScorer", "setup_distributed", "wrap_model", "shard", "all_reduce_sum", "NoWriter",
             "kl_estimators", "response_logprobs"]


def assert_identical_copies(scripts, name):
    copies = {script.__name__: inspect.getsource(getattr(script, name)) for script in scripts if hasattr(script, name)}
    assert len(copies) >= 2, copies.keys()
    first = next(iter(copies.values()))
    assert all(text == first for text in copies.values()), [k for k, v in copies.items() if v != first]


@pytest.mark.parametrize("name", RL_SHARED)
def test_rl_helpers_are_identical_copies(name):
    assert_identical_copies(RL_SCRIPTS, name)


@pytest.mark.parametrize("name", LM_SHARED)
def test_lm_helpers_are_identical_copies(name):
    assert_identical_copies(LM_SCRIPTS, name)


def test_every_helper_with_a_shared_name_is_in_the_lists():
    # a helper of the same name in two scripts is either one canonical copy or a bug waiting to drift
    for scripts, listed in ((RL_SCRIPTS, RL_SHARED), (LM_SCRIPTS, LM_SHARED + ["levenshtein", "gold_score",
                            "make_prompt", "corrupt", "demonstration", "candidate", "preference_pair", "task_rng"])):
        names = {}
        for script in scripts:
            for name, obj in vars(script).items():
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == script.__name__:
                    names.setdefault(name, []).append(script.__name__)
        shared = {name for name, where in names.items() if len(where) >= 2}
        assert shared - set(listed) - {"Args", "Agent", "evaluate", "main"} == set()


def test_no_script_imports_another():
    for script in RL_SCRIPTS + LM_SCRIPTS:
        source = inspect.getsource(script)
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


@pytest.mark.parametrize("name", ["reward_model", "dpo", "rlhf_ppo", "grpo"])
def test_task_copies_agree(name):
    sft_module, other = importlib.import_module("sft"), importlib.import_module(name)
    assert task_data(sft_module, 7) == task_data(other, 7)
    assert task_data(sft_module, 7) != task_data(sft_module, 8)
