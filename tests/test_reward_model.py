"""reward_model.py: the math against hand-computed values, then the script end to end."""
import json

import pytest
import torch
from conftest import only_run_dir, read_scalars, run_script, same_seed_scalars

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
    model = reward_model.TokenScorer(classifier)
    seq = torch.tensor([[118, 114, 117, 119, 35, 52, 53, 61, 52, 53, 1]])
    ones = torch.ones_like(seq)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        plain = reward_model.get_rewards(model, seq, ones)
        right = reward_model.get_rewards(model, torch.cat([seq, pad], 1), torch.cat([ones, pad], 1))
        left = reward_model.get_rewards(model, torch.cat([pad, seq], 1), torch.cat([pad, ones], 1))
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
