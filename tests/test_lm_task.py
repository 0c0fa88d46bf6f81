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
    import reward_model
    import sft

    rows = sft.task_rows(1, "train", 2000, sft.demonstration_row)
    assert {len(row["target"]) for row in rows} == {4, 5, 6, 7, 8}
    assert all(row["prompt"] == f"sort {row['prompt'][5:-1]}:" and row["target"] == "".join(sorted(row["prompt"][5:-1]))
               for row in rows)
    demos = [(row["completion"], row["target"]) for row in rows]
    exact = sum(d == t for d, t in demos) / len(demos)
    assert 0.46 < exact < 0.54  # the sloppy demonstrator is right half the time
    assert all(d == t or (sorted(d) == sorted(t) and sft.levenshtein(d, t) == 2) for d, t in demos)  # else one swap
    pairs = reward_model.task_rows(1, "train", 500, reward_model.preference_row)
    assert all(sft.gold_score(r["chosen"], r["target"]) > sft.gold_score(r["rejected"], r["target"]) for r in pairs)
    assert sum(r["chosen"] == r["target"] for r in pairs) > 250  # a candidate is the target half the time
    # train and eval streams differ
    assert sft.task_rows(1, "train", 1, sft.demonstration_row) != sft.task_rows(1, "eval", 1, sft.demonstration_row)
