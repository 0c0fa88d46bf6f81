"""dpo.py: the math against hand-computed values, then the script end to end."""
import json
import math
import os

import pytest
import torch
from conftest import (
    assert_the_reference_stayed,
    one_line_exit,
    only_run_dir,
    read_scalars,
    reference_after_training,
    run_in_process,
    run_script,
    same_seed_scalars,
    split_rows,
)
from lm_models import PositionLogits, by_hand

import dpo

T = torch.tensor


def test_dpo_loss_variants():
    # log π(y_w) = −3, log π(y_l) = −5, log π_ref(y_w) = −4.5, log π_ref(y_l) = −4 (unequal: a swap of the two
    # references, or of chosen and rejected, changes every value below): logratios 1.5 and −1, h = 2.5
    args = (T([-3.0]), T([-5.0]), T([-4.5]), T([-4.0]))
    # sigmoid, β = .5: −log σ(1.25) = log(1 + e^−1.25) = 0.251929
    loss, r_c, r_r = dpo.dpo_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(0.251929, abs=1e-6)
    assert (r_c.item(), r_r.item()) == (pytest.approx(0.75), pytest.approx(-0.5))  # β · logratio
    # label smoothing ε = .1: .9 · 0.251929 + .1 · (−log σ(−1.25) = 1.25 + 0.251929) = 0.376929
    assert dpo.dpo_loss(*args, beta=0.5, label_smoothing=0.1)[0].item() == pytest.approx(0.376929, abs=1e-6)
    # ipo, β = .5: (h − 1/(2β))² = (2.5 − 1)² = 2.25;  β = .2: (2.5 − 2.5)² = 0
    assert dpo.dpo_loss(*args, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(2.25)
    assert dpo.dpo_loss(*args, beta=0.2, loss_type="ipo")[0].item() == pytest.approx(0.0, abs=1e-6)
    # hinge: max(0, 1 − β h): β = .2 → .5;  β = .5 → 0
    assert dpo.dpo_loss(*args, beta=0.2, loss_type="hinge")[0].item() == pytest.approx(0.5)
    assert dpo.dpo_loss(*args, beta=0.5, loss_type="hinge")[0].item() == pytest.approx(0.0)


def test_dpo_completion_logprobs_sum_the_completion_only():
    # A model whose logits are uniform over 4 tokens: every token costs log 4, so a completion of
    # 3 labeled tokens (prompt of 2 masked, 1 padding) sums to −3 log 4 = −4.158883
    class Uniform(torch.nn.Module):  # an LM head of zeros over 4 tokens
        def __init__(self):
            super().__init__()
            self.lm_head, self.config = torch.nn.Linear(2, 4, bias=False), type("Config", (), {})()
            torch.nn.init.zeros_(self.lm_head.weight)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return type("Out", (), {"logits": self.lm_head(torch.ones(*input_ids.shape, 2))})()

    labels = T([[-100, -100, 1, 2, 3, -100]]).long()
    logps = dpo.completion_logprobs(Uniform(), torch.zeros(1, 6).long(), torch.ones(1, 6).long(), labels)
    assert logps.item() == pytest.approx(-3 * math.log(4))


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_smoke(tiny_checkpoints, tmp_path, loss_type):
    cwd = tmp_path
    run_script("dpo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
               str(tiny_checkpoints["reward_model"]), "--loss-type", loss_type, "--max-steps", "10", "--batch-size", "8", "--num-train-pairs", "200",
               "--eval-size", "16", "--eval-every", "5", "--warmup-steps", "2", "--output-dir", f"models/dpo_{loss_type}",
               cwd=cwd)
    scalars = read_scalars(str(sorted((cwd / "runs").glob("dpo__*"))[-1]))
    for tag in ["train/reward_chosen", "train/reward_rejected", "train/accuracy", "train/margin", "train/logps_chosen",
                "train/logps_rejected", "losses/loss", "eval/accuracy", "eval/gold_accuracy", "eval/gold_score", "eval/score", "eval/kl"]:
        assert tag in scalars, tag
    assert scalars["eval/kl"][0][1] == pytest.approx(0.0, abs=1e-4)  # before training: the reference itself
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(cwd / "models" / f"dpo_{loss_type}")


def test_dpo_log_probs_are_those_of_the_token_after_each_position():
    model = PositionLogits()
    input_ids = torch.tensor([[5, 3, 4, 6, 2], [5, 1, 9, 0, 0]])  # right-padded
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[-100, -100, 4, 6, 2], [-100, 1, 9, -100, -100]])  # the completions
    logits = model(input_ids).logits
    expected = torch.stack([by_hand(logits, input_ids, [(0, 2), (0, 3), (0, 4)]).sum(),
                            by_hand(logits, input_ids, [(1, 1), (1, 2)]).sum()])
    torch.testing.assert_close(dpo.completion_logprobs(model, input_ids, attention_mask, labels), expected)
    # sampled responses, as the evaluation labels them: a context of 2 then 3 response tokens (the second row stops
    # after 1), at a temperature of 2: the log-softmax of logits / 2
    sequences, mask = torch.tensor([[5, 3, 4, 6, 2], [5, 1, 9, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = sequences.masked_fill(torch.nn.functional.pad(torch.tensor([[1, 1, 1], [1, 0, 0]]), (2, 0)) == 0, -100)
    expected = torch.stack([by_hand(logits / 2, sequences, [(0, 2), (0, 3), (0, 4)]).sum(),
                            by_hand(logits / 2, sequences, [(1, 2)]).sum()])
    torch.testing.assert_close(dpo.completion_logprobs(model, sequences, mask, labels, temperature=2.0), expected)


def test_same_seed_same_logs_and_weights(tiny_checkpoints, tmp_path):
    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
             "--max-steps", "10", "--batch-size", "4", "--num-train-pairs", "100", "--eval-size", "8", "--eval-every", "5",
             "--warmup-steps", "1", "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("dpo.py", flags, tmp_path)
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


def completion_logprobs(path, rows, side):
    """log π(completion and its EOS | prompt) of each row's `side` (chosen or rejected), by the saved model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row[side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1)
        out.append(sum(logp[len(prompt) + t - 1, token].item() for t, token in enumerate(completion)))
    return torch.tensor(out)


def test_one_step_raises_the_implicit_reward_margin_on_its_batch(tiny_checkpoints, tmp_path):
    """The direction of the update: the implicit reward margin β[(log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) −
    log π_ref(y_l))], 0 at the start (π_θ = π_ref = the SFT model), is above 0 after one step on a batch that is
    the whole dataset (chosen and rejected swapped, or the loss's sign flipped, push it below)."""
    rows = preference_rows(8, seed=5)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("dpo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "pairs.jsonl",
                   "--reward-model-path", "None", "--max-steps", "1", "--batch-size", "8", "--lr", "1e-4",
                   "--warmup-steps", "0", "--output-dir", "out", cwd=tmp_path)
    ref, new = tiny_checkpoints["sft"], tmp_path / "out"
    margin = ((completion_logprobs(new, rows, "chosen") - completion_logprobs(ref, rows, "chosen"))
              - (completion_logprobs(new, rows, "rejected") - completion_logprobs(ref, rows, "rejected")))
    assert margin.mean() > 1e-3, margin


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reference_stays_the_starting_model(tiny_checkpoints, tmp_path, monkeypatch, lora):
    """KL 0 before the first update; after training the reference computes the SFT model's logits exactly (with
    LoRA: the policy itself, its adapters off) while the policy has moved away from it (KL > 0)."""
    if lora:
        pytest.importorskip("peft")
    sft = tiny_checkpoints["sft"]
    flags = ["--model-name-or-path", str(sft), "--reward-model-path", "None", "--max-steps", "4", "--batch-size", "8",
                  "--num-train-pairs", "64", "--eval-size", "8", "--eval-every", "4", "--warmup-steps", "0", "--output-dir", "out", *(["--lora-r", "4"] if lora else [])]
    scalars, reference = reference_after_training("scale/dpo.py" if lora else "dpo.py", flags, tmp_path, monkeypatch)
    assert_the_reference_stayed(sft, tmp_path / "out", reference, scalars)


def test_it_learns_the_built_in_preferences_in_30_steps(small_checkpoints, tmp_path):
    """From the small SFT model, 30 steps of 32 pairs: the implicit reward ranks 0.77-0.94 of the held-out pairs
    right (seeds 1-3; 0 at step 0, where every margin is 0), at least 0.6; with chosen and rejected swapped, 0.11."""
    run_in_process("dpo.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-model-path", "None",
                   "--max-steps", "30", "--batch-size", "32", "--eval-every", "30", "--eval-size", "64",
                   "--num-train-pairs", "1000", "--output-dir", "out", cwd=tmp_path)
    assert read_scalars(only_run_dir(tmp_path))["eval/accuracy"][-1][1] >= 0.6


def test_bad_input_says_which_script_to_run_first(tiny_checkpoints, tmp_path):
    assert "models/sft" in one_line_exit("dpo.py", cwd=tmp_path) and "python sft.py" in one_line_exit("dpo.py", cwd=tmp_path)
    message = one_line_exit("dpo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--loss-type", "nope", cwd=tmp_path)
    assert "sigmoid" in message
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "models")


def test_implicit_prompt_pairs_from_a_local_file(tiny_checkpoints, tmp_path):
    """TRL's implicit-prompt preference format, as a local .jsonl file, with a reward model for eval/score; a dataset
    without chosen and rejected is one line naming the columns it has."""
    (tmp_path / "prefs.jsonl").write_text("\n".join(
        json.dumps({"chosen": f"sort {i}9:{i}9", "rejected": f"sort {i}9:9{i}"}) for i in range(40)))
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("dpo.py", "--dataset-name", "prefs.jsonl", "--model-name-or-path", str(models / "sft"),
                   "--reward-model-path", str(models / "reward_model"), "--max-steps", "4", "--batch-size", "4",
                   "--eval-every", "2", "--warmup-steps", "1", "--output-dir", "dpo", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert "eval/kl" in scalars and "eval/score" in scalars and "eval/gold_accuracy" not in scalars
    assert (tmp_path / "dpo" / "config.json").exists()
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"sort {i}1:"}) for i in range(40)))
    message = one_line_exit("dpo.py", "--dataset-name", "prompts.jsonl", "--model-name-or-path", str(models / "sft"),
                            cwd=tmp_path)
    assert "['prompt']" in message and "chosen and rejected" in message


def test_the_sampled_evaluation_completes_each_distinct_prompt_once():
    """With a dataset, the evaluation samples one completion for each distinct prompt of the held-out pairs, in the
    order first seen (in TRL's preference data several pairs share a prompt; sampling one twice would weigh it
    twice in eval/kl and eval/score); an implicit-prompt pair's empty prompt has nothing to complete."""
    from types import SimpleNamespace

    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    a, b = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("sort 21:", "sort 3:"))
    texts, ids, targets = dpo.eval_prompts_of(SimpleNamespace(dataset_name="prefs.jsonl"), tokenizer, [a, b, a, [], b])
    assert ids == [a, b] and texts == ["sort 21:", "sort 3:"] and targets is None


@pytest.mark.parametrize("script", ["dpo.py", "scale/dpo.py"])
def test_a_run_samples_each_distinct_eval_prompt_once(tiny_checkpoints, tmp_path, script):
    """The same in a run of either tier (scale/dpo.py finds the distinct prompts in its own main): 40 pairs of three
    prompts, 4 held out (a tenth: two share a prompt), and the evaluation's samples are one for each prompt."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "prefs.jsonl").write_text("\n".join(
        json.dumps({"prompt": f"sort {i % 3}8:", "chosen": f"{i % 3}8", "rejected": f"8{i % 3}"}) for i in range(40)))
    run_in_process(script, "--dataset-name", "prefs.jsonl", "--model-name-or-path", str(tiny_checkpoints["sft"]),
                   "--reward-model-path", "None", "--max-steps", "1", "--batch-size", "4", "--warmup-steps", "0",
                   "--output-dir", "dpo", cwd=tmp_path)
    events = EventAccumulator(only_run_dir(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    samples = events.Tensors("eval/samples/text_summary")[-1].tensor_proto.string_val[0].decode().split("\n")
    prompts = list(dict.fromkeys(row["prompt"] for row in split_rows(tmp_path / "prefs.jsonl")[1]))
    assert len(prompts) == 3 and [" ".join(line.split()[:2]) for line in samples] == prompts, samples


@pytest.mark.parametrize("loss_type,beta,label_smoothing", [("ipo", 0.3, 0.0), ("sigmoid", 0.2, 0.1)])
def test_the_loss_flags_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch, loss_type, beta, label_smoothing):
    """--loss-type, --beta and --label-smoothing reach the loss of each update step. A loop that ignores one of
    them fails."""
    seen, real = [], dpo.dpo_loss

    def spy(*args):
        seen.append((torch.is_grad_enabled(), args[4:]))
        return real(*args)

    monkeypatch.setattr(dpo, "dpo_loss", spy)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in preference_rows(8, seed=5)))
    run_in_process("dpo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "pairs.jsonl",
                   "--reward-model-path", "None", "--max-steps", "2", "--batch-size", "4", "--loss-type", loss_type,
                   "--beta", str(beta), "--label-smoothing", str(label_smoothing), "--output-dir", "out", cwd=tmp_path)
    assert [grad for grad, _ in seen] == [True, True]  # 8 pairs: none held out, so no evaluation
    assert {flags for _, flags in seen} == {(beta, loss_type, label_smoothing)}


def test_the_batch_size_and_max_length_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch):
    """--batch-size and --max-length shape each update: 3 pairs a step (the policy's pass over 6 sequences), no
    side longer than 16 tokens, on data where most pairs are longer (and dropped). A loop that reads either flag at
    its default (64) fails."""
    seen, real = [], dpo.collate

    def spy(batch, pad_token_id):
        if torch.is_grad_enabled():  # the policy's pass in an update: the reference's and evaluate's run under no_grad
            seen.append([len(ids) for ids, _ in batch])
        return real(batch, pad_token_id)

    monkeypatch.setattr(dpo, "collate", spy)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["sft"])
    rows = preference_rows(60, seed=7)  # the first 6 held out for evaluation
    length = lambda r: sum(len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen")) + 1  # noqa: E731
    assert sum(length(r) > 16 for r in rows[6:]) > 30 and sum(length(r) <= 16 for r in rows[6:]) >= 6
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("dpo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "pairs.jsonl",
                   "--reward-model-path", "None", "--max-steps", "4", "--batch-size", "3", "--max-length", "16",
                   "--eval-every", "100", "--output-dir", "out", cwd=tmp_path)
    assert len(seen) == 4 and all(len(batch) == 6 for batch in seen), seen
    assert max(max(batch) for batch in seen) <= 16, seen


@pytest.mark.parametrize("script,logps,scores", [("dpo.py", "completion_logprobs", "response_scores"),
                                                 ("scale/dpo.py", "response_logps", "response_scores")])
def test_the_evaluation_takes_its_temperature_and_missing_eos_penalty(script, logps, scores, tiny_checkpoints, tmp_path,
                                                                      monkeypatch):
    """The evaluation's eval/kl compares the policy and the reference at --temperature (the distribution it samples
    from: both log-probs of each of its batches), and its eval/score gives a completion with no stop token
    --missing-eos-penalty; dpo.py's updates take their log-probs at temperature 1. A script that reads either flag
    at its default (1.0, −3.0) in one of these places fails."""
    import importlib

    from conftest import module_name

    module, temperatures, penalties = importlib.import_module(module_name(script)), [], []
    real_logps, real_scores = getattr(module, logps), getattr(module, scores)

    def logps_spy(*args, **kwargs):  # (model, sequences, attention_mask, labels or context_length[, temperature])
        temperatures.append(args[4] if len(args) > 4 else kwargs.get("temperature", 1.0))
        return real_logps(*args, **kwargs)

    monkeypatch.setattr(module, logps, logps_spy)
    monkeypatch.setattr(module, scores, lambda *args: penalties.append(args[-1]) or real_scores(*args))
    run_in_process(script, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), "--num-train-pairs", "40", "--max-steps", "2", "--eval-every",
                   "2", "--batch-size", "8", "--eval-size", "6", "--temperature", "0.7", "--missing-eos-penalty", "-7",
                   "--output-dir", "out", cwd=tmp_path)
    # two evaluations (steps 0 and 2) of one batch of 6 prompts: the policy's and the reference's log-probs
    assert temperatures.count(0.7) == 4 and set(temperatures) <= {0.7, 1.0}, temperatures
    assert penalties == [-7.0, -7.0], penalties
