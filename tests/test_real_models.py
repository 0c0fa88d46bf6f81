"""The LM scripts on the path users take: pretrained checkpoints of real architectures (saved in float32,
bf16 or fp16), BPE tokenizers with BOS / no pad / pad == EOS / a chat template, and data in TRL's formats.
Every model and tokenizer is built here (tests/conftest.py), nothing is downloaded."""
import json
import math
import os

import pytest
import torch
from conftest import TOKENIZER_KINDS, read_scalars, run_in_process, save_checkpoint

ARCHS = ["llama", "qwen2", "gpt_neox", "gpt2"]
DTYPES = ["float32", "bfloat16", "float16"]
KINDS = list(TOKENIZER_KINDS)
# The data format each tokenizer kind is run with: conversational formats need a chat template
FORMATS = {
    "eos_no_pad": dict(sft="prompt_completion", preference="explicit", prompts="text"),
    "bos": dict(sft="text", preference="implicit", prompts="text"),
    "pad_is_eos": dict(sft="messages", preference="conversational_implicit", prompts="conversational"),
    "chat_eot": dict(sft="conversational_prompt_completion", preference="conversational_explicit",
                     prompts="conversational"),
}


def sort_rows(n=48):
    """(question, right answer, wrong answer) triples in the words of the tokenizers' corpus."""
    rows = []
    for i in range(n):
        digits = [str((i * 7 + k * 3) % 10) for k in range(3 + i % 3)]
        right = " ".join(sorted(digits))
        wrong = " ".join(reversed(sorted(digits))) if len(set(digits)) > 1 else right + " 0"
        rows.append((f"sort {' '.join(digits)}:", right, wrong))
    return rows


def chat(user, assistant=None):
    turns = [{"role": "user", "content": user}]
    return turns + [{"role": "assistant", "content": assistant}] if assistant is not None else turns


def write_data(path, fmt):
    """A .jsonl file of one TRL format."""
    rows = []
    for q, right, wrong in sort_rows():
        rows.append({
            "prompt_completion": {"prompt": q, "completion": " " + right},
            "text": {"text": f"{q} {right}"},
            "messages": {"messages": chat(q, right) + chat("again?", right)},
            "conversational_prompt_completion": {"prompt": chat(q), "completion": [{"role": "assistant", "content": right}]},
            "explicit": {"prompt": q, "chosen": " " + right, "rejected": " " + wrong},
            "implicit": {"chosen": f"{q} {right}", "rejected": f"{q} {wrong}"},
            "conversational_explicit": {"prompt": chat(q), "chosen": [{"role": "assistant", "content": right}],
                                        "rejected": [{"role": "assistant", "content": wrong}]},
            "conversational_implicit": {"chosen": chat(q, right), "rejected": chat(q, wrong)},
            "text_prompts": {"prompt": q},
            "conversational_prompts": {"prompt": chat(q)},
        }[fmt])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def state(path, auto="AutoModelForCausalLM"):
    import transformers

    model = getattr(transformers, auto).from_pretrained(path)
    return model, {k: v.float().clone() for k, v in model.state_dict().items()}


def assert_finite_logs(run_dir):
    for tag, values in read_scalars(run_dir).items():
        assert all(math.isfinite(v) for _, v in values), (tag, values)


def changed_fraction(before, after):
    """The fraction of the entries of the tensors both state dicts share (same shape) that changed."""
    keys = [k for k in before if k in after and before[k].shape == after[k].shape]
    changed = sum((before[k] != after[k]).sum().item() for k in keys)
    return changed / sum(before[k].numel() for k in keys)


CELLS = [(arch, dtype, KINDS[(i + j) % len(KINDS)]) for i, arch in enumerate(ARCHS) for j, dtype in enumerate(DTYPES)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,kind", CELLS, ids=[f"{a}-{d}-{k}" for a, d, k in CELLS])
def test_pipeline_on_a_pretrained_checkpoint(tmp_path, arch, dtype, kind):
    """sft → reward_model → rlhf_ppo, and dpo, through the scripts' entry points, on a tiny random checkpoint
    of a real architecture saved in `dtype`, with the data formats of `kind`'s tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    fmt = FORMATS[kind]
    base = save_checkpoint(str(tmp_path / "base"), arch, kind, dtype, padded_vocab=(arch == "qwen2"))
    sft_data = write_data(tmp_path / "sft.jsonl", fmt["sft"])
    pref_data = write_data(tmp_path / "pref.jsonl", fmt["preference"])
    prompt_data = write_data(tmp_path / "prompts.jsonl", f"{fmt['prompts']}_prompts")
    common = ["--warmup-steps", "0", "--eval-every", "2", "--max-steps", "4", "--batch-size", "8"]
    run_in_process("sft.py", "--model-name-or-path", base, "--dataset-name", sft_data, "--lr", "3e-3",
                   "--output-dir", "sft", *common, cwd=tmp_path)
    run_in_process("reward_model.py", "--model-name-or-path", "sft", "--dataset-name", pref_data, "--lr", "3e-3",
                   "--output-dir", "rm", *common, cwd=tmp_path)
    run_in_process("rlhf_ppo.py", "--sft-model-path", "sft", "--reward-model-path", "rm", "--dataset-name", prompt_data,
                   "--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "2",
                   "--response-length", "8", "--eval-every", "1", "--lr", "3e-3", "--output-dir", "ppo", cwd=tmp_path)
    run_in_process("dpo.py", "--model-name-or-path", "sft", "--reward-model-path", "rm", "--dataset-name", pref_data,
                   "--response-length", "8", "--lr", "3e-3", "--output-dir", "dpo", *common, cwd=tmp_path)

    runs = {d.name.split("__")[0]: str(d) for d in (tmp_path / "runs").iterdir()}
    logs = {name: read_scalars(run_dir) for name, run_dir in runs.items()}
    for run_dir in runs.values():
        assert_finite_logs(run_dir)
    # the trained weights moved, in float32 (the master weights), from where each stage started
    _, base_state = state(base)
    sft_model, sft_state = state(tmp_path / "sft")
    assert sft_model.dtype == torch.float32
    assert changed_fraction(base_state, sft_state) > 0.5  # embedding rows of unseen tokens may stay
    for name in ("ppo", "dpo"):
        assert changed_fraction(sft_state, state(tmp_path / name)[1]) > 0.5, name
    rm_model, rm_state = state(tmp_path / "rm", "AutoModelForSequenceClassification")
    assert changed_fraction(sft_state, rm_state) > 0.5
    # PPO's first minibatch recomputes exactly the rollout's log-probs
    assert [v for _, v in logs["rlhf_ppo"]["policy/first_ratio_max_error"]] == [0.0, 0.0]
    # the saved checkpoints give the outputs the runs logged: eval/loss recomputed from the reloaded models
    assert logs["sft"]["eval/loss"][-1][1] == pytest.approx(sft_eval_loss(tmp_path / "sft", sft_data), abs=1e-4)
    assert logs["reward_model"]["eval/loss"][-1][1] == pytest.approx(rm_eval_loss(tmp_path / "rm", pref_data), abs=1e-4)
    assert logs["dpo"]["eval/loss"][-1][1] == pytest.approx(dpo_eval_loss(tmp_path, pref_data), abs=1e-4)
    report = os.environ.get("LM_MATRIX_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(dict(arch=arch, dtype=dtype, tokenizer=kind, **fmt,
                                    first_ratio_error=max(v for _, v in logs["rlhf_ppo"]["policy/first_ratio_max_error"]),
                                    sft_loss=logs["sft"]["train/loss"][-1][1] if "train/loss" in logs["sft"] else None,
                                    sft_eval_loss=logs["sft"]["eval/loss"][-1][1],
                                    rm_eval_loss=logs["reward_model"]["eval/loss"][-1][1],
                                    ppo_policy_loss=logs["rlhf_ppo"]["losses/policy_loss"][-1][1],
                                    ppo_value_loss=logs["rlhf_ppo"]["losses/value_loss"][-1][1],
                                    dpo_eval_loss=logs["dpo"]["eval/loss"][-1][1])) + "\n")


def eval_rows(data):
    """The rows a script holds out for evaluation from a file with no test split: the first tenth."""
    rows = [json.loads(line) for line in open(data)]
    return rows[: len(rows) // 10]


@torch.no_grad()
def sft_eval_loss(path, data):
    import sft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    examples = [sft.tokenize(row, tokenizer, sft.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    input_ids, attention_mask, labels = sft.collate(examples, tokenizer.pad_token_id)
    return sft.sft_loss(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels).item()


@torch.no_grad()
def rm_eval_loss(path, data):
    import reward_model as rm
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    triples = [rm.tokenize_preference(tokenizer, row, rm.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    sequences = [p + c for p, c, _ in triples] + [p + r for p, _, r in triples]
    rewards = rm.get_rewards(model, *rm.batch_tensors(sequences, tokenizer.pad_token_id, "cpu"))
    return rm.bradley_terry_loss(rewards[: len(triples)], rewards[len(triples) :]).item()


@torch.no_grad()
def dpo_eval_loss(root, data):
    import dpo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "dpo")
    triples = [dpo.tokenize_preference(tokenizer, row, dpo.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    batch = [(p + c, [-100] * len(p) + c) for p, c, _ in triples] + [(p + r, [-100] * len(p) + r) for p, _, r in triples]
    logps = {}
    for name in ("dpo", "sft"):
        model = AutoModelForCausalLM.from_pretrained(root / name).eval()
        logps[name] = dpo.sequence_logps(model, *dpo.collate(batch, tokenizer.pad_token_id))
    n = len(triples)
    return dpo.dpo_loss(logps["dpo"][:n], logps["dpo"][n:], logps["sft"][:n], logps["sft"][n:], beta=0.5)[0].item()
