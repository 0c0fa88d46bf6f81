"""sft.py and reward_model.py: the math against hand-computed values, then the scripts end to end."""
import json
import math
import os

import pytest
import torch
from conftest import TINY_LM, assert_one_line_error, only_run_dir, read_scalars, run_script

import reward_model
import sft


def test_sft_loss_masks_prompt_and_padding():
    # Vocabulary of 2, sequences of 3; logits at position t predict label t+1.
    #   example 1: labels [−100 (prompt), 1, 0 (EOS)]:
    #     position 0 logits (0, log 3) → p(1) = 3/4, nll = −log .75 = 0.287682
    #     position 1 logits (0, 0)     → p(0) = 1/2, nll = log 2   = 0.693147
    #   example 2: labels [−100, 1, −100 (padding)]:
    #     position 0 logits (log 3, 0) → p(1) = 1/4, nll = log 4   = 1.386294
    #     position 1 would predict padding: no loss, whatever its logits (99, −99)
    #   mean over the 3 labeled tokens: 2.367123 / 3 = 0.789041
    logits = torch.tensor([[[0, math.log(3)], [0, 0], [5, 5]],
                           [[math.log(3), 0], [99, -99], [5, 5]]], dtype=torch.float32)
    labels = torch.tensor([[-100, 1, 0], [-100, 1, -100]])
    assert sft.sft_loss(logits, labels).item() == pytest.approx(0.789041, abs=1e-6)
    # split into two micro-batches with num_items = 3, the halves add up to the same loss
    halves = sft.sft_loss(logits[:1], labels[:1], 3) + sft.sft_loss(logits[1:], labels[1:], 3)
    assert halves.item() == pytest.approx(0.789041, abs=1e-6)


def test_messages_format_takes_loss_on_assistant_turns_only():
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "42"}]
    ids, labels = sft.tokenize({"messages": messages}, tokenizer, sft.stop_token_ids(tokenizer))
    # a template with no end-of-turn token: the conversation ends with EOS, as a text completion does
    assert tokenizer.decode(ids) == "<user>hi\n<assistant>yo\n<user>ok\n<assistant>42\n</s>"
    # the assistant headers are prompt; the loss is on each assistant reply, its newline, and the final EOS
    assert tokenizer.decode([i for i, label in zip(ids, labels) if label != -100]) == "yo\n42\n</s>"
    assert all(label in (i, -100) for i, label in zip(ids, labels))


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


def test_smoke_checkpoints_load_with_auto_classes(tiny_checkpoints):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["sft"])
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_checkpoints["reward_model"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["reward_model"])
    assert lm.config.n_layer == 1 and rm.config.num_labels == 1
    assert rm.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    assert json.load(open(tiny_checkpoints["sft"] / "training_args.json"))["max_steps"] == 30
    runs = {os.path.basename(d).split("__")[0]: d for d in (tiny_checkpoints["cwd"] / "runs").iterdir()}
    sft_tags = read_scalars(str(runs["sft"]))
    for tag in ["train/loss", "eval/loss", "eval/gold_accuracy", "eval/gold_score", "eval/gold_accuracy_greedy",
                "charts/samples_per_second", "charts/tokens_per_second"]:
        assert tag in sft_tags, tag
    rm_tags = read_scalars(str(runs["reward_model"]))
    for tag in ["train/loss", "train/accuracy", "train/reward_chosen", "train/reward_rejected", "train/margin",
                "eval/loss", "eval/accuracy", "eval/gold_correlation"]:
        assert tag in rm_tags, tag
    assert not [p for p in os.listdir(tiny_checkpoints["cwd"] / "models") if ".tmp" in p]  # renamed when complete


def test_sft_on_a_local_jsonl_file_from_a_saved_model(tiny_checkpoints, tmp_path):
    rows = [{"prompt": f"add {i} {i}:", "completion": str(2 * i)} for i in range(60)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_script("sft.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "data.jsonl",
               "--max-steps", "4", "--batch-size", "8", "--gradient-accumulation-steps", "2", "--eval-every", "2",
               "--output-dir", "out", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert "eval/loss" in scalars and "eval/gold_accuracy" not in scalars  # no gold reward for real data
    assert os.path.exists(tmp_path / "out" / "config.json")


def test_reward_model_on_a_local_jsonl_file_with_margin(tiny_checkpoints, tmp_path):
    rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}", "margin": 0.5}
            for i in range(1, 8)] * 10
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_script("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name",
               "prefs.jsonl", "--max-steps", "3", "--batch-size", "4", "--eval-every", "3", "--output-dir", "rm",
               cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert "eval/accuracy" in scalars and "eval/gold_correlation" not in scalars


def test_bad_input_one_line_errors(tmp_path):
    # reward_model.py before sft.py: says what to run first
    proc = run_script("reward_model.py", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "models/sft", "python sft.py")
    proc = run_script("sft.py", "--model-name-or-path", "./no/such/model", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "./no/such/model")
    # a dataset with columns sft.py cannot use: names the columns found and the formats accepted
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    proc = run_script("sft.py", *TINY_LM, "--dataset-name", "bad.jsonl", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "question", "answer", "prompt+completion")
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "models")
