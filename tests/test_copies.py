"""Scripts share nothing, so what several scripts need is pasted into each, and each file holds only what its
own main runs. These tests check both, per top-level definition (function, class or assigned name), within each
tier: a name defined in two or more top-level scripts is one text in all of them (RL and LM families alike), and
so is a name defined in two or more of scale/'s full programs. Across the tiers, one computation keeps one name
even where scale/'s text does more (ranks, chunks, a CUDA graph); tests/test_tiers.py checks that the two compute
the same thing. No script holds a definition that nothing it runs reaches. Each script keeps its own Args, Agent,
act, evaluate, main, check_args and load_models (the models it trains and scores with). A math dispatch (DISPATCH:
advantages, per-token losses, aggregation, the clip's counts) holds only the rows its own file offers, so its text
differs where the rows do; test_each_row_of_a_dispatch_computes_the_same_wherever_it_stands checks its rows instead."""
import ast
import functools
import os

import pytest

import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_SCRIPTS = ["ppo_clip", "ppo_kl", "ppo_continuous"]
LM_SCRIPTS = ["sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]
DISTILL = ["distill", "agent_grpo", "kto"]  # top-level only: no scale/ sibling
SCALE_SCRIPTS = [f"scale/{script}" for script in LM_SCRIPTS]  # the full programs the top-level LM files are the reference of
OWN = {"Args", "Agent", "act", "evaluate", "main", "check_args", "load_models"}  # each script's own
DISPATCH = {"compute_advantages", "token_losses", "clipped_tokens", "aggregate_loss"}  # each file's rows: tested below
BANNER = "# Plumbing"
REWARDS = "# Rewards as plain Python functions"


def read(script):
    with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
        return f.read()


@functools.cache
def parse(text):
    """A script's syntax tree, parsed once per text: the checks below read each script many times (read-only)."""
    return ast.parse(text)


def definitions(text):
    """{name: (source text, ast node)} of a script's top-level functions, classes and assigned names; the
    text of a function or class includes its decorators."""
    lines, found = text.splitlines(keepends=True), {}
    for node in parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for name in names:
            found[name] = ("".join(lines[first - 1 : node.end_lineno]), node)
    return found


def unreached(text):
    """The top-level definitions that nothing the script runs reaches. The roots are the module-level statements
    that are not definitions or imports (the __main__ block); a definition reached names, directly or through
    others, what else is reached."""
    tree, defs = parse(text), definitions(text)
    named = lambda node: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}  # noqa: E731
    roots = set()
    for node in tree.body:
        is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)) \
                and not is_docstring:
            roots |= named(node)
    reached, todo = set(), [name for name in roots if name in defs]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [n for n in named(defs[name][1]) if n in defs]
    return sorted(set(defs) - reached)


def differing_names(found):
    """The names defined in two or more scripts with more than one text, except OWN and DISPATCH; `found` is
    {script: definitions(its text)}."""
    copies = {}
    for script, defs in found.items():
        for name, (source, _) in defs.items():
            copies.setdefault(name, {})[script] = source
    return sorted(name for name, where in copies.items()
                  if name not in OWN | DISPATCH and len(where) >= 2 and len(set(where.values())) > 1)


def shared_names(found):
    counts = {}
    for defs in found.values():
        for name in defs:
            counts[name] = counts.get(name, 0) + 1
    return {name for name, n in counts.items() if n >= 2} - OWN - DISPATCH


TIERS = {"top-level": RL_SCRIPTS + LM_SCRIPTS + DISTILL, "scale": SCALE_SCRIPTS}
# the names scale/ gave computations that the top-level references also do: each is now the reference's name
SECOND_NAMES = {"sample": "generate", "response_logprobs": "policy_logprobs", "reward_table": "reward_terms",
                "score_responses": "response_scores", "token_scores": "scalar_head",
                "sequence_logps": "completion_logprobs", "completion_logps": "completion_logprobs",
                "save_atomically": "save_model", "load_model": "load_no_dropout", "get_rewards": "sequence_rewards",
                "masked_whiten_over_ranks": "masked_whiten",
                "reinforce_pp_advantages_over_ranks": "reinforce_pp_advantages", "batch_tensors": "collate"}


def all_definitions(tier):
    return {s: definitions(read(s)) for s in TIERS[tier]}


@pytest.mark.parametrize("tier", TIERS)
def test_a_name_in_two_scripts_of_a_tier_is_one_text_in_all(tier):
    found = all_definitions(tier)
    assert differing_names(found) == []
    # the check sees what the families share with each other, not only within each
    expected = ({"levenshtein", "generate", "save_model", "load_no_dropout", "scalar_head", "gold_score"} if tier == "top-level"
                else {"random_streams", "set_random_streams", "Preemption", "shard", "generate", "all_reduce_sum",
                      "place_model", "levenshtein", "save_model", "load_no_dropout", "scalar_head"})
    assert expected <= shared_names(found)


def test_a_drifted_copy_within_a_tier_is_caught_and_a_difference_across_tiers_is_not():
    """generate has two texts across the tiers (scale/'s shares prompts' caches and has a CUDA graph): not a
    drift. One letter changed in grpo.py's copy alone is, and the check names it."""
    top, scale = all_definitions("top-level"), all_definitions("scale")
    assert top["grpo"]["generate"][0] != scale["scale/grpo"]["generate"][0]
    source, node = top["grpo"]["generate"]
    drifted = {**top, "grpo": {**top["grpo"], "generate": (changed_by_one_letter(source), node)}}
    assert differing_names(drifted) == ["generate"]


def test_one_computation_has_one_name_across_the_tiers():
    """Each top-level LM reference and its scale/ program name the computations they share alike: a function or
    class the reference defines is defined under the same name in scale/ (the loop's named steps too: sample_groups
    and Groups, completion_rewards, log_grpo_iteration, ...), but for the reference's own evaluation and loading
    and the plain forward passes that scale/ does in chunks (gather_logprobs: scale/'s head_logprobs). None of
    scale/'s former second names is back."""
    own = {"evaluate", "eval_prompts_of", "load_models", "gather_logprobs", "make_model", "make_tokenizer",
           "load_pretrained",
           "term_means",  # scale/ adds up each term's sums over the ranks (term_sums)
           "sequence_rewards"}  # scale/dpo, rlhf_ppo and grpo score in response_scores, as a TokenScorer
    for script in LM_SCRIPTS:
        top = {n for n, (_, node) in definitions(read(script)).items() if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert top - set(definitions(read(f"scale/{script}"))) - own == set(), script
    for second, name in SECOND_NAMES.items():
        assert any(name in definitions(read(s)) for s in SCALE_SCRIPTS), name
        assert not any(second in definitions(read(s)) for s in SCALE_SCRIPTS + LM_SCRIPTS), second


def changed_by_one_letter(source):
    """`source` with its first letter past the middle made another, where the text still parses (not a keyword's)."""
    for at in (j for j in range(len(source) // 2, len(source)) if source[j].isalpha()):
        changed = source[:at] + ("x" if source[at] != "x" else "y") + source[at + 1 :]
        try:
            ast.parse(changed if not source.startswith(" ") else "if 1:\n" + changed)
            return changed
        except SyntaxError:
            continue


@pytest.mark.parametrize("tier", TIERS)
def test_one_character_changed_in_any_copy_is_caught(tier):
    """Each shared name, changed by one letter in one of its copies (a different script in turn): the check names
    it and nothing else. Once per script the change is made in the file's text, which is parsed again."""
    found = all_definitions(tier)
    shared = sorted(shared_names(found))
    in_text = set()
    for i, name in enumerate(shared):
        holders = [s for s in found if name in found[s]]
        script = holders[i % len(holders)]
        source, node = found[script][name]
        changed = changed_by_one_letter(source)
        if script not in in_text:  # through the file: definitions() must see the change
            in_text.add(script)
            assert read(script).count(source) == 1
            mutated = definitions(read(script).replace(source, changed))
        else:
            mutated = {**found[script], name: (changed, node)}
        assert differing_names({**found, script: mutated}) == [name], (name, script)
    assert len(shared) > (60 if tier == "scale" else 40) and in_text == set(found)


@pytest.mark.parametrize("script", RL_SCRIPTS + LM_SCRIPTS + DISTILL + SCALE_SCRIPTS)
def test_every_top_level_definition_is_reached(script):
    assert unreached(read(script)) == []


def test_an_unreached_definition_is_caught():
    text = read("sft") + "\n\ndef never_called():\n    return gold_score('1', '1')\n"
    assert unreached(text) == ["never_called"]
    # reached through another definition counts: main reaches head_logprobs, which reaches HEAD_CHUNK_ELEMENTS
    text = read("scale/sft")
    assert "HEAD_CHUNK_ELEMENTS" not in unreached(text) and "HEAD_CHUNK_ELEMENTS = " in text


def sections(text):
    """The titles of the plumbing sections below the banner, in order: the first line of each dashed header."""
    below = text[text.index(BANNER) :].splitlines()
    return [below[i + 1] for i in range(len(below) - 1) if below[i].startswith("# ---") and
            not below[i + 1].startswith("# ---") and (i == 0 or not below[i - 1].startswith("#"))]


@pytest.mark.parametrize("family", ["rl", "lm"])
def test_one_banner_and_one_order_of_sections(family):
    """Every script has the banner; its sections are in the family's one order (a script may lack some), and a
    definition below the banner lies in the same section in every script that has it."""
    scripts = RL_SCRIPTS if family == "rl" else LM_SCRIPTS + DISTILL + SCALE_SCRIPTS
    texts = {s: read(s) for s in scripts}
    assert all(text.count("\n" + BANNER) == 1 for text in texts.values())
    order = max((sections(text) for text in texts.values()), key=len)  # the script that has every section
    for script, text in texts.items():
        found = sections(text)
        assert set(found) <= set(order) and found == sorted(found, key=order.index), script
    where = {}
    for text in texts.values():
        below = text.index("\n" + BANNER)
        for name, (source, _) in definitions(text).items():
            at = text.find(source)
            if at > below:
                titles = [t for t in sections(text) if text.index(t, below) < at]
                where.setdefault(name, set()).add(titles[-1] if titles else "")
    assert {name: titles for name, titles in where.items() if len(titles) > 1} == {}


def rewards_section(text):
    """grpo.py's and rlhf_ppo.py's reward functions: from their section's first line to the argument checks."""
    return text[text.rindex("\n# ----", 0, text.index(REWARDS)) + 1 : text.index("\ndef check_args(")]


def test_the_reward_functions_are_one_text_in_grpo_rlhf_ppo_and_agent_grpo():
    first, *others = (rewards_section(read(script)) for script in ("grpo", "rlhf_ppo", "agent_grpo", "scale/grpo",
                                                                   "scale/rlhf_ppo"))
    assert all(other == first for other in others) and "BUILTIN_REWARDS = {" in first and first.count("\ndef ") == 8


def test_no_script_imports_another():
    for script in RL_SCRIPTS + LM_SCRIPTS + DISTILL + SCALE_SCRIPTS:
        source = read(script)
        for other in RL_SCRIPTS + LM_SCRIPTS + DISTILL:
            assert f"import {other}\n" not in source and f"from {other} " not in source and "from scale" not in source


# ------------------------------------------------------------------------- the built-in sort task
def task_data(module, seed):
    """Every kind of row a script makes, 200 each, from one script's text of the task."""
    return [module.task_rows(seed, "train", 200, getattr(module, row))
            for row in ("demonstration_row", "preference_row", "prompt_row") if hasattr(module, row)]


def test_the_task_depends_on_the_seed_and_its_splits_differ():
    import dpo
    import reward_model

    assert task_data(dpo, 7)[0] == task_data(reward_model, 7)[0]  # the preference rows
    assert task_data(sft, 7)[0] != task_data(sft, 8)[0]
    assert sft.task_rows(7, "train", 5, sft.demonstration_row) != sft.task_rows(7, "eval", 5, sft.demonstration_row)
    # every kind of row begins with the same draw of the prompt: the same prompts for every stage of one seed
    prompts = [[row["prompt"] for row in rows] for module in (sft, dpo) for rows in task_data(module, 7)]
    assert len(prompts) == 3 and prompts[0][0] == prompts[1][0] == prompts[2][0]


# ------------------------------------------------------------------------- the rows of each math dispatch
def dispatch_rows():
    """(name, row, {file: the row's result}) for every row of every DISPATCH function, in each file that has it:
    grpo.py (the reference's rows), agent_grpo.py (the default recipe's), scale/grpo.py (every row). Inputs with
    unequal values, ratios on both sides of the clip and an unscored reward (NaN)."""
    import agent_grpo
    import grpo
    from scale import grpo as scale_grpo

    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    ratio = 0.6 + 0.8 * torch.rand(6, 5, generator=g)  # 0.6 to 1.4: clipped below and above at ε = 0.2
    logprobs, advantages = -torch.rand(6, 5, generator=g) * 3, torch.tensor([1.5, -0.5, 0.25, -2.0, 0.0, 0.75])
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    rewards = torch.tensor([0.1, 0.9, 0.4, float("nan"), 1.0, 0.2, 0.2, 0.7])
    files = {"grpo": grpo, "agent_grpo": agent_grpo, "scale/grpo": scale_grpo}
    rows = []
    for kind in ("grpo", "dapo", "dr_grpo", "cispo"):
        losses = scale_grpo.token_losses(ratio, logprobs, advantages, kind, 0.2, 0.28 if kind != "cispo" else 1.3)
        rows.append(("aggregate_loss", kind, {f: m.aggregate_loss(losses, mask, kind, 6, 17.5, 5)
                                              for f, m in files.items() if kind != "cispo" or f != "agent_grpo"}))
    for kind in ("grpo", "cispo"):
        high = 0.28 if kind == "grpo" else 1.3
        rows.append(("token_losses", kind, {f: files[f].token_losses(ratio, logprobs, advantages, kind, 0.2, high)
                                            for f in ("grpo", "scale/grpo")}))
        results = {f: files[f].clipped_tokens(ratio, advantages, 0.2, high, kind) for f in ("grpo", "scale/grpo")}
        if kind == "grpo":  # agent_grpo's has the clipped surrogate's row alone, so no loss type
            results["agent_grpo"] = agent_grpo.clipped_tokens(ratio, advantages, 0.2, high)
        rows.append(("clipped_tokens", kind, {f: torch.stack(r) for f, r in results.items()}))
    for advantage in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        for scale in ("group", "none") if advantage == "grpo" else ("group",):
            results = {f: files[f].compute_advantages(rewards, 4, advantage, scale) for f in ("grpo", "scale/grpo")}
            if (advantage, scale) == ("grpo", "group"):
                results["agent_grpo"] = agent_grpo.compute_advantages(rewards, 4)
            rows.append(("compute_advantages", f"{advantage}-{scale}", results))
    return rows


def test_each_row_of_a_dispatch_computes_the_same_wherever_it_stands():
    """Each row of a dispatch (a loss type, an advantage) in every file that offers it gives the same numbers,
    bitwise; the reference's rows are in scale/ too, and agent_grpo.py's default recipe's in grpo.py."""
    import torch

    rows = dispatch_rows()
    assert {(name, row) for name, row, _ in rows} >= {("aggregate_loss", "dr_grpo"), ("compute_advantages", "rloo-group"),
                                                      ("token_losses", "cispo"), ("clipped_tokens", "grpo")}
    for name, row, results in rows:
        first, *others = results.values()
        assert len(results) >= 2 and not first.isnan().all(), (name, row)
        assert all(torch.equal(first, other) for other in others), (name, row, results)
    assert {f for name, row, results in rows if (name, row) == ("aggregate_loss", "grpo") for f in results} == {
        "grpo", "agent_grpo", "scale/grpo"}


def test_a_row_that_computes_otherwise_is_caught(monkeypatch):
    """agent_grpo.py's dapo row dividing by the minibatch's own tokens (not the rollout's per minibatch) differs from
    grpo.py's and scale/'s, and the check says which row."""
    import agent_grpo

    aggregate = agent_grpo.aggregate_loss
    monkeypatch.setattr(agent_grpo, "aggregate_loss", lambda losses, mask, kind, *a: (losses * mask).sum() / mask.sum()
                        if kind == "dapo" else aggregate(losses, mask, kind, *a))
    import torch

    differing = [(name, row) for name, row, results in dispatch_rows()
                 if not all(torch.equal(r, next(iter(results.values()))) for r in results.values())]
    assert differing == [("aggregate_loss", "dapo")]
