"""kto.py: the math against hand-computed values, the data's unpairing and order, then the script end to end: what
an update does to desirable and undesirable completions, where the reference point's log-probs come from, the frozen
reference, the flags' effect, the bad-input lines."""
import json
import os
import random

import pytest
import torch
from conftest import (
    assert_the_reference_stayed,
    one_line_exit,
    only_run_dir,
    read_scalars,
    reference_after_training,
    run_in_process,
    same_seed_scalars,
)

import kto

T = torch.tensor


def test_kto_loss_by_hand():
    # log π = −3, −5; log π_ref = −4.5, −4 (unequal: swapping the models or the labels changes every value): h = 1.5
    # on the desirable completion, −1 on the undesirable one; kl = 0.4, β = 0.5, λ_D = 1.5, λ_U = 0.8
    logps, ref, desirable = T([-3.0, -5.0]), T([-4.5, -4.0]), T([True, False])
    loss, rewards = kto.kto_loss(logps, ref, desirable, T(0.4), 0.5, 1.5, 0.8)
    # desirable: 1.5 (1 − σ(0.5 (1.5 − 0.4))) = 1.5 (1 − σ(0.55)) = 0.548797; undesirable: 0.8 (1 − σ(0.5 (0.4 + 1)))
    # = 0.8 (1 − σ(0.7)) = 0.265450; their mean over the two completions
    assert loss.item() == pytest.approx((0.548797 + 0.265450) / 2, abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.75, -0.5])  # r = β h
    # apo_zero_unpaired: 1.5 (1 − σ(0.75)) = 0.481232 and 0.8 σ(−0.5) = 0.302033, no reference point
    apo, _ = kto.kto_loss(logps, ref, desirable, T(0.4), 0.5, 1.5, 0.8, "apo_zero_unpaired")
    assert apo.item() == pytest.approx((0.481232 + 0.302033) / 2, abs=1e-6)
    # the gradient: a desirable completion's log-prob is pushed up, an undesirable one's down
    logps.requires_grad_(True)
    kto.kto_loss(logps, ref, desirable, T(0.4), 0.5, 1.5, 0.8)[0].backward()
    assert logps.grad[0] < 0 < logps.grad[1]


def test_the_reference_point_is_the_clamped_mean_of_mismatched_log_ratios_without_gradient():
    policy = T([-2.0, -3.0, -1.0], requires_grad=True)
    kl = kto.kl_estimate(policy, T([-2.5, -2.0, -2.2]))  # log-ratios 0.5, −1, 1.2: mean 0.233333
    assert kl.item() == pytest.approx(0.7 / 3) and not kl.requires_grad
    assert kto.kl_estimate(T([-3.0, -3.0]), T([-2.0, -2.5])).item() == 0.0  # a mean of −0.75 clamped at 0


def test_mismatched_pairs_rotate_the_completions_by_one():
    batch = [("x0", "y0", True, None), ("x1", "y1", False, None), ("x2", "y2", True, None)]
    assert kto.mismatched_pairs(batch) == [("x0", "y2"), ("x1", "y0"), ("x2", "y1")]


def test_trl_weight_advice():
    # 400 desirable, 100 undesirable: λ_D in [100/400, 1.33 · 100/400] = [0.25, 0.33] or λ_U in [400/100/1.33, 4] =
    # [3.01, 4.0] (TRL's rounding); the defaults are in neither
    line = kto.weight_advice(400, 100, 1.0, 1.0)
    assert "[0.25, 0.33]" in line and "[3.01, 4.0]" in line and line.startswith("note:")
    assert kto.weight_advice(400, 100, 0.3, 1.0) is None and kto.weight_advice(400, 100, 1.0, 3.5) is None
    assert kto.weight_advice(400, 100, 1.0, 3.0) is None  # 3 < 3.01, but then λ_D = 1 is in [0.75, 1.0]
    assert "[0.5, 0.67]" in kto.weight_advice(400, 100, 1.0, 2.0)
    assert kto.weight_advice(250, 250, 1.0, 9.0) is None  # balanced: no advice


def test_unpaired_batches_keep_a_pairs_halves_apart():
    class Identity:  # an rng whose shuffle keeps the order, so the batches are known by hand
        def shuffle(self, order):
            pass

    # pairs 0, 0, 1, 1 in batches of 2: row 1 waits (row 0, its other half, is in the batch), row 2 fills the batch
    assert kto.unpaired_batches([0, 0, 1, 1], 2, Identity()) == [[0, 2], [1, 3]]
    assert kto.unpaired_batches([None, None, None], 2, Identity()) == [[0, 1], [2]]
    pairs = [k // 2 for k in range(40)] + [None] * 7
    for seed in range(20):
        batches = kto.unpaired_batches(pairs, 8, random.Random(seed))
        assert sorted(i for b in batches for i in b) == list(range(47))  # every row once
        for b in batches:
            halves = [pairs[i] for i in b if pairs[i] is not None]
            assert len(halves) == len(set(halves)) and len(b) <= 8


def test_keep_fraction_leaves_out_halves_of_random_pairs():
    examples = [(p, c, label, k) for k in range(8) for p, c, label in (("x", "good", True), ("x", "bad", False))]
    kept = kto.keep_fraction(examples, 0.2, random.Random(0))  # 8 chosen and 8 · 0.2 / 0.8 = 2 rejected: 1:4
    assert sum(e[2] for e in kept) == 8 and sum(not e[2] for e in kept) == 2
    kept = kto.keep_fraction(examples, 0.8, random.Random(0))  # 8 rejected and 2 chosen
    assert sum(e[2] for e in kept) == 2 and sum(not e[2] for e in kept) == 8


# ------------------------------------------------------------------------------------ end to end
def unpaired_rows(n, seed):
    """n unpaired rows of a sort task made here: the sorted digits desirable, an adjacent swap undesirable, each row
    its own prompt (no two halves of one pair)."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        d = "".join(sorted(rng.choice("0123456789") for _ in range(rng.randint(4, 6))))
        j = next((j for j in range(len(d) - 1) if d[j] != d[j + 1]), None)
        if j is not None:
            good = len(rows) % 2 == 0
            rows.append({"prompt": f"sort {d[::-1]}:", "completion": d if good else d[:j] + d[j + 1] + d[j] + d[j + 2 :],
                         "label": good})
    return rows


def logprobs(path, pairs):
    """log π(completion | prompt) of each (prompt ids, completion ids) by the saved model at `path`, by hand."""
    from transformers import AutoModelForCausalLM

    model, out = AutoModelForCausalLM.from_pretrained(path).eval(), []
    for prompt, completion in pairs:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1)
        out.append(sum(logp[len(prompt) + t - 1, token].item() for t, token in enumerate(completion)))
    return torch.tensor(out)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("label", [True, False], ids=["desirable", "undesirable"])
def test_one_step_raises_desirable_and_lowers_undesirable_completions(tiny_checkpoints, tmp_path, loss_type, label):
    """One step on a batch that is the whole dataset, 8 completions all desirable (all undesirable): their mean
    log-prob is above (below) the SFT model's after it. The labels read the wrong way round, or the loss's sign
    flipped, turn both."""
    rows = [{**row, "label": label} for row in unpaired_rows(8, seed=5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("kto.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "rows.jsonl",
                   "--reward-model-path", "None", "--max-steps", "1", "--batch-size", "8", "--lr", "1e-4",
                   "--loss-type", loss_type, "--warmup-steps", "0", "--output-dir", "out", cwd=tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["sft"])
    pairs = [kto.tokenize_pair(tokenizer, r["prompt"], r["completion"], kto.stop_token_ids(tokenizer)) for r in rows]
    moved = (logprobs(tmp_path / "out", pairs) - logprobs(tiny_checkpoints["sft"], pairs)).mean().item()
    assert moved > 1e-4 if label else moved < -1e-4, moved


def test_the_reference_point_reads_the_mismatched_pairs_of_the_policy_of_that_moment(tiny_checkpoints, tmp_path,
                                                                                   monkeypatch):
    """At step 2 the reference point is max(0, mean(log π_θ(y_{i−1}|x_i) − log π_ref(y_{i−1}|x_i))) with π_θ the
    policy after one update (a 1-step run's saved model: the same seed, the same first step) and π_ref the SFT model,
    over that batch's mismatched pairs, recomputed here by hand. Matched pairs, the policy of the start, or a
    reference that moved give another number."""
    rows = unpaired_rows(16, seed=3)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    flags = ["--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", str(tmp_path / "rows.jsonl"),
             "--reward-model-path",
             "None", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "0", "--eval-size", "0", "--output-dir", "out"]
    os.makedirs(tmp_path / "one")
    os.makedirs(tmp_path / "two")
    run_in_process("kto.py", *flags, "--max-steps", "1", cwd=tmp_path / "one")
    batches, kls = [], []
    real_pairs, real_kl = kto.mismatched_pairs, kto.kl_estimate
    monkeypatch.setattr(kto, "mismatched_pairs", lambda batch: batches.append(batch) or real_pairs(batch))
    monkeypatch.setattr(kto, "kl_estimate", lambda *a: kls.append((a[0] - a[1]).mean().item()) or real_kl(*a))
    run_in_process("kto.py", *flags, "--max-steps", "2", cwd=tmp_path / "two")
    batch = batches[1]
    mismatched = [(batch[i][0], batch[i - 1][1]) for i in range(len(batch))]
    matched = [(p, c) for p, c, _, _ in batch]
    after_one, sft = tmp_path / "one" / "out", tiny_checkpoints["sft"]
    expected = (logprobs(after_one, mismatched) - logprobs(sft, mismatched)).mean().item()
    assert kls[1] == pytest.approx(expected, abs=1e-4)
    assert abs(expected - (logprobs(after_one, matched) - logprobs(sft, matched)).mean().item()) > 1e-3
    assert abs(expected) > 1e-3  # the policy of the start would give 0


def test_the_reference_stays_the_starting_model(tiny_checkpoints, tmp_path, monkeypatch):
    """KL 0 before the first update; after training the reference computes the SFT model's logits exactly while the
    policy has moved away from it (KL > 0)."""
    sft = tiny_checkpoints["sft"]
    flags = ["--model-name-or-path", str(sft), "--reward-model-path", "None", "--max-steps", "4", "--batch-size", "8",
             "--num-train-pairs", "64", "--eval-size", "8", "--eval-every", "4", "--warmup-steps", "0", "--output-dir",
             "out"]
    scalars, reference = reference_after_training("kto.py", flags, tmp_path, monkeypatch)
    assert_the_reference_stayed(sft, tmp_path / "out", reference, scalars)


def test_kto_smoke_logs_its_tags_and_the_weights_reach_the_loss(tiny_checkpoints, tmp_path, capsys):
    """The built-in task at 1:4 with λ_D = 1.5, λ_U = 0.8: at step 0 every r is 0 and the reference point 0, so each
    completion's loss is λ_y (1 − σ(0)) = λ_y / 2 and eval/loss over the held-out pairs' halves (as many of each) is
    (1.5 + 0.8) / 4 = 0.575; TRL's advice is printed for the 1:4 training data."""
    run_in_process("kto.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                         str(tiny_checkpoints["reward_model"]), "--max-steps", "10", "--batch-size", "8",
                         "--num-train-pairs", "200", "--eval-size", "16", "--eval-every", "5", "--warmup-steps", "2",
                         "--undesirable-fraction", "0.2", "--desirable-weight", "1.5", "--undesirable-weight", "0.8",
                         "--output-dir", "models/kto", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    for tag in ["train/reward_chosen", "train/reward_rejected", "train/margin", "train/logps_chosen", "train/kl",
                "train/logps_rejected", "losses/loss", "eval/loss", "eval/accuracy", "eval/gold_accuracy",
                "eval/gold_score", "eval/score", "eval/kl"]:
        assert tag in scalars, tag
    assert scalars["eval/kl"][0][1] == pytest.approx(0.0, abs=1e-4)  # before training: the reference itself
    assert scalars["eval/loss"][0][1] == pytest.approx(0.575, abs=1e-6)
    assert scalars["train/kl"][0][1] == 0.0  # step 1: π_θ = π_ref
    out = capsys.readouterr().out
    assert "TRL advises" in out and "--undesirable-weight in [" in out
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "kto")


def test_same_seed_same_logs_and_weights(tiny_checkpoints, tmp_path):
    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
             "--max-steps", "10", "--batch-size", "4", "--num-train-pairs", "100", "--eval-size", "8", "--eval-every", "5",
             "--warmup-steps", "1", "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("kto.py", flags, tmp_path)
    assert [tag for tag in logs_a if logs_a[tag] != logs_b.get(tag)] == [] and len(logs_a) >= 5
    assert saved_a == saved_b and len(saved_a) == 1


def test_it_learns_the_built_in_preferences_in_30_steps(small_checkpoints, tmp_path):
    """From the small SFT model, 30 steps of 64 completions: the implied reward ranks most held-out pairs right
    (0 at step 0, where every r is 0), at least 0.6; with the labels read the wrong way round, far below."""
    run_in_process("kto.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-model-path", "None",
                   "--max-steps", "30", "--batch-size", "64", "--eval-every", "30", "--eval-size", "64",
                   "--num-train-pairs", "1000", "--output-dir", "out", cwd=tmp_path)
    assert read_scalars(only_run_dir(tmp_path))["eval/accuracy"][-1][1] >= 0.6


def test_bad_input_is_one_line_before_any_work(tiny_checkpoints, tmp_path):
    sft = str(tiny_checkpoints["sft"])
    rows = unpaired_rows(8, seed=1)
    rows[5]["label"] = 1
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    message = one_line_exit("kto.py", "--model-name-or-path", sft, "--dataset-name", "rows.jsonl", cwd=tmp_path)
    assert "rows.jsonl, line 6" in message and "`label` is a number (1), not true or false" in message
    rows[5]["label"] = True
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert "unpaired" in one_line_exit("kto.py", "--model-name-or-path", sft, "--dataset-name", "rows.jsonl",
                                       "--undesirable-fraction", "0.2", cwd=tmp_path)
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"sort {i}1:"}) for i in range(8)))
    assert "prompt, completion and label" in one_line_exit("kto.py", "--model-name-or-path", sft, "--dataset-name",
                                                            "prompts.jsonl", cwd=tmp_path)
    assert "fill no batch of --batch-size 6" in one_line_exit("kto.py", "--model-name-or-path", sft, "--num-train-pairs",
                                                             "5", "--batch-size", "6", cwd=tmp_path)
    assert "at least 2" in one_line_exit("kto.py", "--model-name-or-path", sft, "--batch-size", "1", cwd=tmp_path)
    assert "apo_zero_unpaired" in one_line_exit("kto.py", "--model-name-or-path", sft, "--loss-type", "nope",
                                                cwd=tmp_path)
    assert "between 0 and 1" in one_line_exit("kto.py", "--undesirable-fraction", "1", cwd=tmp_path)
    assert "python sft.py" in one_line_exit("kto.py", cwd=tmp_path)
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "models")


@pytest.mark.parametrize("loss_type,beta,weights", [("kto", 0.3, (1.5, 0.8)), ("apo_zero_unpaired", 0.2, (0.7, 2.0))])
def test_the_loss_flags_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch, loss_type, beta, weights):
    """--loss-type, --beta, --desirable-weight and --undesirable-weight reach the loss of each update step, with
    the labels of the batch trained on and, for apo_zero_unpaired, a reference point of 0. A loop that ignores one of
    them fails."""
    seen, real = [], kto.kto_loss

    def spy(*args):
        seen.append((torch.is_grad_enabled(), args[2].tolist(), float(args[3]), args[4:]))
        return real(*args)

    monkeypatch.setattr(kto, "kto_loss", spy)
    rows = unpaired_rows(8, seed=5)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("kto.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "rows.jsonl",
                   "--reward-model-path", "None", "--max-steps", "2", "--batch-size", "8", "--loss-type", loss_type,
                   "--beta", str(beta), "--desirable-weight", str(weights[0]), "--undesirable-weight", str(weights[1]),
                   "--output-dir", "out", cwd=tmp_path)
    assert [grad for grad, *_ in seen] == [True, True]  # 8 rows: none held out, so no evaluation
    assert {flags for *_, flags in seen} == {(beta, *weights, loss_type)}
    assert all(sorted(labels) == [False] * 4 + [True] * 4 for _, labels, _, _ in seen)  # the batch is the 8 rows
    if loss_type == "apo_zero_unpaired":
        assert [kl for _, _, kl, _ in seen] == [0.0, 0.0]


def test_conversational_unpaired_rows_on_a_random_qwen2(tmp_path):
    """TRL's conversational unpaired format (a user message, the assistant's reply, a label) on a tiny random Qwen2
    with a ChatML template whose end of turn is not EOS: the run trains, logs both kinds' rewards and saves a model
    that loads; each completion ends at <|im_end|>, the end of turn."""
    from lm_models import save_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = save_checkpoint(str(tmp_path / "base"), "qwen2", "pad_is_eos", "float32")
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}
            for r in unpaired_rows(24, seed=2)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(base)
    _, completion = kto.tokenize_pair(tokenizer, rows[0]["prompt"], rows[0]["completion"], kto.stop_token_ids(tokenizer))
    assert completion[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_in_process("kto.py", "--model-name-or-path", base, "--dataset-name", "chat.jsonl", "--reward-model-path",
                   "None", "--max-steps", "2", "--batch-size", "8", "--response-length", "4", "--output-dir", "out",
                   cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert {"train/reward_chosen", "train/reward_rejected", "eval/loss"} <= set(scalars)
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
