"""The built-in sort task (each LM script carries a copy; tests/test_copies.py checks that they agree)."""
import importlib

import pytest

SCRIPTS = [name for name in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo") if importlib.util.find_spec(name)]


def test_levenshtein_and_gold_score():
    import sft

    # kitten → sitting: k→s, e→i, +g = 3.  An adjacent swap costs 2 edits (no transposition).
    assert sft.levenshtein("kitten", "sitting") == 3
    assert sft.levenshtein("13859", "13589") == 2
    assert sft.levenshtein("", "abc") == 3
    assert sft.gold_score("13589", "13589") == 1.0
    assert sft.gold_score("13859", "13589") == pytest.approx(1 - 2 / 5)  # 0.6
    assert sft.gold_score("1358", "13589") == pytest.approx(1 - 1 / 5)  # a dropped digit: 0.8
    assert sft.gold_score("", "1234") == 0.0
    assert sft.gold_score("123456789999", "1234") == 0.0  # distance 8 > length 4: capped at 0


def test_task_distribution():
    import sft

    rng = sft.task_rng(1, "train")
    prompts = [sft.make_prompt(rng) for _ in range(2000)]
    assert {len(t) for _, t in prompts} == {4, 5, 6, 7, 8}
    assert all(p == f"sort {p[5:-1]}:" and t == "".join(sorted(p[5:-1])) for p, t in prompts)
    demos = [(sft.demonstration(rng, t), t) for _, t in prompts]
    exact = sum(d == t for d, t in demos) / len(demos)
    assert 0.46 < exact < 0.54  # the sloppy demonstrator is right half the time
    assert all(d == t or (sorted(d) == sorted(t) and sft.levenshtein(d, t) == 2) for d, t in demos)  # else one swap
    pairs = [sft.preference_pair(rng) for _ in range(500)]
    assert all(sft.gold_score(c, t) > sft.gold_score(r, t) for _, c, r, t in pairs)
    # train and eval streams differ
    assert sft.make_prompt(sft.task_rng(1, "train")) != sft.make_prompt(sft.task_rng(1, "eval"))
