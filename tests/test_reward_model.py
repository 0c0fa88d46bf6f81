"""reward_model.py: the math against hand-computed values, then the script end to end."""
import json

import pytest
import torch
from conftest import (
    assert_one_line_error,
    only_run_dir,
    read_scalars,
    run_in_process,
    run_script,
    same_seed_scalars,
    split_rows,
)

import reward_model


def test_bradley_terry_loss_with_margin_and_centering():
    # r_c = (2, 0), r_r = (0, 1), margin (1, 0): logits r_c − r_r − m = (1, −1)
    #   −log σ(1) = log(1 + e^−1) = 0.313262;  −log σ(−1) = log(1 + e) = 1.313262;  mean 0.813262
    #   centering 0.1 · mean((2 + 0)², (0 + 1)²) = 0.1 · 2.5 = 0.25  →  1.063262
    r_c, r_r, margin = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])
    assert reward_model.bradley_terry_loss(r_c, r_r, margin).item() == pytest.approx(0.813262, abs=1e-6)
    assert reward_model.bradley_terry_loss(r_c, r_r, margin, 0.1).item() == pytest.approx(1.063262, abs=1e-6)
    # without margin: log(1 + e^−2) = 0.126928 and log(1 + e^1) = 1.313262; mean 0.720095
    assert reward_model.bradley_terry_loss(r_c, r_r).item() == pytest.approx(0.720095, abs=1e-6)


def test_last_token_index_under_padding():
    # right padding: 3 tokens → index 2; no padding → 4.  left padding: the last position, 4.
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert reward_model.last_token_index(mask).tolist() == [2, 4, 4]


def test_rewards_do_not_depend_on_padding(tiny_checkpoints):
    from transformers import AutoModelForSequenceClassification

    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_checkpoints["reward_model"]).eval()
    seq = torch.tensor([[118, 114, 117, 119, 35, 52, 53, 61, 52, 53, 1]])
    ones = torch.ones_like(seq)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        plain = reward_model.sequence_rewards(classifier, seq, ones)
        right = reward_model.sequence_rewards(classifier, torch.cat([seq, pad], 1), torch.cat([ones, pad], 1))
        left = reward_model.sequence_rewards(classifier, torch.cat([pad, seq], 1), torch.cat([pad, ones], 1))
    assert right.item() == pytest.approx(plain.item(), abs=1e-5)
    assert left.item() == pytest.approx(plain.item(), abs=1e-5)


def test_reward_model_on_a_local_jsonl_file_with_margin(tiny_checkpoints, tmp_path):
    rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}", "margin": 0.5}
            for i in range(1, 8)] * 10
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_script("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name",
               "prefs.jsonl", "--max-steps", "3", "--batch-size", "4", "--eval-every", "3", "--output-dir", "rm",
               cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert "eval/accuracy" in scalars and "eval/gold_correlation" not in scalars


def test_same_seed_same_logs_and_weights(tiny_checkpoints, tmp_path):
    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--max-steps", "10", "--eval-every", "5",
             "--num-train-pairs", "200", "--eval-size", "16", "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("reward_model.py", flags, tmp_path)
    assert [tag for tag in logs_a if logs_a[tag] != logs_b.get(tag)] == [] and len(logs_a) >= 5
    assert saved_a == saved_b and len(saved_a) == 1


def preference_rows(n, seed):
    """n preference pairs of a sort task made here: the sorted digits chosen, one adjacent swap rejected."""
    import random

    rng, rows = random.Random(seed), []
    while len(rows) < n:
        d = "".join(sorted(rng.choice("0123456789") for _ in range(rng.randint(4, 6))))
        j = next((j for j in range(len(d) - 1) if d[j] != d[j + 1]), None)
        if j is not None:
            rows.append({"prompt": f"sort {d[::-1]}:", "chosen": d, "rejected": d[:j] + d[j + 1] + d[j] + d[j + 2 :]})
    return rows


def p_chosen(path, rows):
    """Mean P(chosen ≻ rejected) = σ(r_c − r_r) over the rows, each sequence scored alone by the saved classifier at
    its last token (the EOS after the completion)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def score(prompt, completion):
        ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    return sum(torch.sigmoid(torch.tensor(score(r["prompt"], r["chosen"]) - score(r["prompt"], r["rejected"]))).item()
               for r in rows) / len(rows)


def test_one_step_raises_p_chosen_over_rejected_on_its_batch(tiny_checkpoints, tmp_path):
    """The direction of the update: one step, at a small learning rate, on a batch that is the whole dataset raises
    the model's P(chosen ≻ rejected) on it (trained on swapped pairs, or with the loss's sign flipped, it falls)."""
    rows = preference_rows(8, seed=4)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["reward_model"]), "--dataset-name",
                   "pairs.jsonl", "--max-steps", "1", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "0",
                   "--output-dir", "out", cwd=tmp_path)
    before, after = p_chosen(tiny_checkpoints["reward_model"], rows), p_chosen(tmp_path / "out", rows)
    assert after > before + 1e-5, (before, after)


def test_it_learns_the_built_in_preferences_in_40_steps(small_checkpoints, tmp_path):
    """From the small SFT model, 40 steps of 32 pairs: held-out pairwise accuracy 0.72-0.77 (seeds 1-3), at least
    0.65; trained on swapped pairs it is 0.23."""
    run_in_process("reward_model.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--max-steps", "40",
                   "--batch-size", "32", "--eval-every", "40", "--eval-size", "64", "--num-train-pairs", "2000",
                   "--output-dir", "out", cwd=tmp_path)
    assert read_scalars(only_run_dir(tmp_path))["eval/accuracy"][-1][1] >= 0.65


def test_before_sft_it_says_what_to_run_first(tmp_path):
    assert_one_line_error(run_script("reward_model.py", cwd=tmp_path, check=False), "models/sft", "python sft.py")


def test_the_margin_and_the_centering_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch):
    """A dataset's `margin` column and --center-rewards-coefficient reach the loss of each update step: the margins
    of the batch's rows, in its order, and the coefficient. A loop that drops either fails."""
    seen, real = [], reward_model.bradley_terry_loss

    def spy(rewards_chosen, rewards_rejected, margin=None, center_rewards_coefficient=None):
        if torch.is_grad_enabled():
            seen.append((margin.tolist() if margin is not None else None, center_rewards_coefficient))
        return real(rewards_chosen, rewards_rejected, margin, center_rewards_coefficient)

    monkeypatch.setattr(reward_model, "bradley_terry_loss", spy)
    rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}", "margin": 0.5 * (i % 3)}
            for i in range(1, 8)] * 4
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name",
                   "prefs.jsonl", "--max-steps", "2", "--batch-size", "4", "--center-rewards-coefficient", "0.01",
                   "--output-dir", "rm", cwd=tmp_path)
    assert len(seen) == 2 and all(coefficient == 0.01 for _, coefficient in seen)
    assert all(margin is not None and len(margin) == 4 and set(margin) <= {0.0, 0.5, 1.0} for margin, _ in seen)
    assert any(len(set(margin)) > 1 for margin, _ in seen), seen  # the batch's own margins, not one value


def test_the_batch_size_and_max_length_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch):
    """--batch-size and --max-length shape each update: 3 pairs a step (6 sequences), no side longer than 16 tokens,
    on data where most pairs are longer (and dropped). A loop that reads either flag at its default (64) fails."""
    seen, real = [], reward_model.collate

    def spy(batch, pad_token_id):
        if torch.is_grad_enabled():  # the updates' batches: evaluate runs under no_grad
            seen.append([len(ids) for ids, _ in batch])
        return real(batch, pad_token_id)

    monkeypatch.setattr(reward_model, "collate", spy)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["sft"])
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(r) for r in preference_rows(60, seed=7)))
    train = split_rows(tmp_path / "prefs.jsonl")[0]  # 6 held out for evaluation
    length = lambda r: sum(len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen")) + 1  # noqa: E731
    assert sum(length(r) > 16 for r in train) > 25 and sum(length(r) <= 16 for r in train) >= 6
    run_in_process("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name",
                   "prefs.jsonl", "--max-steps", "4", "--batch-size", "3", "--max-length", "16", "--eval-every", "100",
                   "--output-dir", "rm", cwd=tmp_path)
    assert len(seen) == 4 and all(len(batch) == 6 for batch in seen), seen
    assert max(max(batch) for batch in seen) <= 16, seen
