"""The LM scripts on the path users take: pretrained checkpoints of real architectures (saved in float32,
bf16 or fp16), BPE tokenizers with BOS / no pad / pad == EOS / a chat template, and data in TRL's formats.
Every model and tokenizer is built here (tests/lm_models.py), nothing is downloaded."""
import json
import math
import os

import pytest
import torch
from conftest import (
    CPU_FLOAT32,
    TINY_LM,
    assert_one_line_error,
    one_line_exit,
    read_scalars,
    run_in_process,
    run_script,
    split_rows,
)
from lm_models import TOKENIZER_KINDS, make_model, make_tokenizer, save_checkpoint

import dpo
import grpo
import reward_model
import rlhf_ppo
import sft
from scale import dpo as scale_dpo

ARCHS = ["llama", "qwen2", "gpt_neox", "gpt2"]
DTYPES = ["float32", "bfloat16", "float16"]
KINDS = [kind for kind in TOKENIZER_KINDS if not kind.startswith("tools")]  # tool templates: tests of their own
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
    """sft → reward_model → rlhf_ppo, and dpo and grpo (reward model), through the scripts' entry points, on a tiny random checkpoint
    of a real architecture saved in `dtype`, with the data formats of `kind`'s tokenizer."""
    fmt = FORMATS[kind]
    base = save_checkpoint(str(tmp_path / "base"), arch, kind, dtype, padded_vocab=(arch == "qwen2"))
    sft_data = write_data(tmp_path / "sft.jsonl", fmt["sft"])
    pref_data = write_data(tmp_path / "pref.jsonl", fmt["preference"])
    prompt_data = write_data(tmp_path / "prompts.jsonl", f"{fmt['prompts']}_prompts")
    common = ["--warmup-steps", "0", "--eval-every", "2", "--max-steps", "4", "--batch-size", "8"]
    # saved in float32 (not the checkpoint's own dtype, the default): the reloaded models must give the logged losses
    run_in_process("sft.py", *CPU_FLOAT32, "--model-name-or-path", base, "--dataset-name", sft_data, "--lr", "3e-3",
                   "--output-dir", "sft", "--save-dtype", "float32", *common, cwd=tmp_path)
    run_in_process("reward_model.py", *CPU_FLOAT32, "--model-name-or-path", "sft", "--dataset-name", pref_data, "--lr", "3e-3",
                   "--output-dir", "rm", "--save-dtype", "float32", *common, cwd=tmp_path)
    run_in_process("rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", "sft", "--reward-model-path", "rm", "--dataset-name", prompt_data,
                   "--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "2",
                   "--response-length", "8", "--eval-every", "1", "--lr", "3e-3", "--output-dir", "ppo", cwd=tmp_path)
    run_in_process("dpo.py", *CPU_FLOAT32, "--model-name-or-path", "sft", "--reward-model-path", "rm", "--dataset-name", pref_data,
                   "--response-length", "8", "--lr", "3e-3", "--output-dir", "dpo", "--save-dtype", "float32", *common, cwd=tmp_path)
    run_in_process("grpo.py", *CPU_FLOAT32, "--model-name-or-path", "sft", "--reward-model-path", "rm",
                   "--dataset-name", prompt_data, "--num-iterations", "2", "--batch-size", "8", "--num-generations", "4",
                   "--mini-batch-size", "4", "--response-length", "8", "--eval-every", "1", "--lr", "3e-3",
                   "--output-dir", "grpo", cwd=tmp_path)

    runs = {d.name.split("__")[0]: str(d) for d in (tmp_path / "runs").iterdir()}
    logs = {name: read_scalars(run_dir) for name, run_dir in runs.items()}
    for run_dir in runs.values():
        assert_finite_logs(run_dir)
    # the trained weights moved, in float32 (the master weights), from where each stage started
    _, base_state = state(base)
    sft_model, sft_state = state(tmp_path / "sft")
    assert sft_model.dtype == torch.float32
    assert changed_fraction(base_state, sft_state) > 0.5  # embedding rows of unseen tokens may stay
    for name in ("ppo", "dpo", "grpo"):
        assert changed_fraction(sft_state, state(tmp_path / name)[1]) > 0.5, name
    _, rm_state = state(tmp_path / "rm", "AutoModelForSequenceClassification")
    assert changed_fraction(sft_state, rm_state) > 0.5
    # PPO's first minibatch recomputes exactly the rollout's log-probs
    assert [v for _, v in logs["rlhf_ppo"]["policy/first_ratio_max_error"]] == [0.0, 0.0]
    assert [v for _, v in logs["grpo"]["policy/first_ratio_max_error"]] == [0.0, 0.0]
    # the saved checkpoints give the outputs the runs logged: eval/loss recomputed from the reloaded models
    assert logs["sft"]["eval/loss"][-1][1] == pytest.approx(sft_eval_loss(tmp_path / "sft", sft_data), abs=1e-4)
    assert logs["reward_model"]["eval/loss"][-1][1] == pytest.approx(rm_eval_loss(tmp_path / "rm", pref_data), abs=1e-4)
    assert logs["dpo"]["eval/loss"][-1][1] == pytest.approx(dpo_eval_loss(tmp_path, pref_data), abs=1e-4)
    report = os.environ.get("LM_MATRIX_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(dict(arch=arch, dtype=dtype, tokenizer=kind, **fmt,
                                    first_ratio_error=max(v for _, v in logs["rlhf_ppo"]["policy/first_ratio_max_error"]),
                                    sft_loss=logs["sft"]["losses/loss"][-1][1] if "losses/loss" in logs["sft"] else None,
                                    sft_eval_loss=logs["sft"]["eval/loss"][-1][1],
                                    rm_eval_loss=logs["reward_model"]["eval/loss"][-1][1],
                                    ppo_policy_loss=logs["rlhf_ppo"]["losses/policy_loss"][-1][1],
                                    ppo_value_loss=logs["rlhf_ppo"]["losses/value_loss"][-1][1],
                                    dpo_eval_loss=logs["dpo"]["eval/loss"][-1][1],
                                    grpo_first_ratio_error=max(v for _, v in logs["grpo"]["policy/first_ratio_max_error"]),
                                    grpo_eval_score=logs["grpo"]["eval/score"][-1][1])) + "\n")


def eval_rows(data):
    """The rows a script holds out for evaluation from a file with no test split, at the default --eval-size and --seed."""
    return split_rows(data)[1]


@torch.no_grad()
def sft_eval_loss(path, data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale import sft  # the full program's chunked head: another computation than sft.py's

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    examples = [sft.tokenize(row, tokenizer, sft.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    input_ids, attention_mask, labels = sft.collate(examples, tokenizer.pad_token_id)
    logprobs = sft.head_logprobs(model, sft.next_tokens(labels), input_ids=input_ids, attention_mask=attention_mask)
    return sft.sft_loss(logprobs, labels).item()


@torch.no_grad()
def rm_eval_loss(path, data):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from scale import reward_model as rm  # the full program's scorer, on every position

    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    triples = [rm.tokenize_preference(tokenizer, row, rm.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    sequences = [p + c for p, c, _ in triples] + [p + r for p, _, r in triples]
    rewards = rm.sequence_rewards(rm.TokenScorer(model), *rm.collate([(s, s) for s in sequences], tokenizer.pad_token_id)[:2])
    return rm.bradley_terry_loss(rewards[: len(triples)], rewards[len(triples) :]).item()


@torch.no_grad()
def dpo_eval_loss(root, data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale import dpo  # the full program's chunked head: another computation than dpo.py's

    tokenizer = AutoTokenizer.from_pretrained(root / "dpo")
    triples = [dpo.tokenize_preference(tokenizer, row, dpo.stop_token_ids(tokenizer)) for row in eval_rows(data)]
    batch = [(p + c, [-100] * len(p) + c) for p, c, _ in triples] + [(p + r, [-100] * len(p) + r) for p, _, r in triples]
    logps = {}
    for name in ("dpo", "sft"):
        model = AutoModelForCausalLM.from_pretrained(root / name).eval()
        logps[name] = dpo.completion_logprobs(model, *dpo.collate(batch, tokenizer.pad_token_id))
    n = len(triples)
    return dpo.dpo_loss(logps["dpo"][:n], logps["dpo"][n:], logps["sft"][:n], logps["sft"][n:], beta=0.5)[0].item()


# ------------------------------------------------------------------------------------------------
# One test per bug of the real-model path; each docstring names the bug it guards (issue: "The LM
# scripts on real checkpoints and real data"), and each failed on the scripts before the fix.
# ------------------------------------------------------------------------------------------------
LM_SCRIPTS = [sft, reward_model, rlhf_ppo, dpo, grpo]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_are_trained_in_float32(tmp_path, dtype):
    """Bug 1: a bf16/fp16 checkpoint was trained in its own dtype. fp16: AdamW's eps rounds to 0 and one step
    turned embedding rows into NaN, saved with exit 0; bf16: at lr 2e-5 about 3/4 of the weights did not move."""
    base = save_checkpoint(str(tmp_path / "base"), "llama", "bos", dtype)
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    run_in_process("sft.py", "--model-name-or-path", base, "--dataset-name", data, "--lr", "2e-5", "--max-steps", "2",
                   "--warmup-steps", "1", "--batch-size", "8", "--eval-every", "2", "--output-dir", "out", "--save-dtype", "float32",
                   cwd=tmp_path)  # saved as trained (by default it would go back to the checkpoint's dtype)
    model, trained = state(tmp_path / "out")
    assert model.dtype == torch.float32
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert changed_fraction(state(base)[1], trained) > 0.99  # measured: 1.0 after the fix


def test_bf16_mixed_precision_trains_with_float32_master_weights(tmp_path):
    """Bug 1, the explicit choice: --bf16 autocasts on the CPU too, and PPO's first ratio stays exactly 1."""
    base = save_checkpoint(str(tmp_path / "base"), "qwen2", "pad_is_eos", "bfloat16")
    sft_data, pref_data = write_data(tmp_path / "s.jsonl", "messages"), write_data(tmp_path / "p.jsonl", "conversational_implicit")
    prompts = write_data(tmp_path / "q.jsonl", "conversational_prompts")
    common = ["--warmup-steps", "0", "--eval-every", "2", "--max-steps", "2", "--batch-size", "8", "--bf16"]
    run_in_process("sft.py", "--model-name-or-path", base, "--dataset-name", sft_data, "--output-dir", "sft", *common,
                   cwd=tmp_path)
    run_in_process("reward_model.py", "--dataset-name", pref_data, "--model-name-or-path", "sft", "--output-dir", "rm",
                   *common, cwd=tmp_path)
    run_in_process("rlhf_ppo.py", "--model-name-or-path", "sft", "--reward-model-path", "rm", "--dataset-name", prompts,
                   "--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "4", "--response-length", "6",
                   "--bf16", "--output-dir", "ppo", "--save-dtype", "float32", cwd=tmp_path)
    scalars = read_scalars(str(next((tmp_path / "runs").glob("rlhf_ppo__*"))))
    assert scalars["policy/first_ratio_max_error"][0][1] == 0.0
    assert state(tmp_path / "ppo")[0].dtype == torch.float32


def test_a_nan_loss_stops_the_run_with_one_line_and_saves_nothing(tmp_path):
    """Bug 1: a loss or gradient norm that became NaN/inf was trained on and saved; now one line names the step."""
    base = save_checkpoint(str(tmp_path / "base"), "gpt2", "eos_no_pad", "float32")
    model, _ = state(base)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
    model.save_pretrained(base)
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    proc = run_script("sft.py", "--model-name-or-path", base, "--dataset-name", data, "--max-steps", "3",
                      "--batch-size", "8", "--output-dir", "out", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "at step 1", "nothing saved")
    assert not (tmp_path / "out").exists()
    # a NaN margin in the data: the reward model's loss is NaN at its first step
    rows = [{"prompt": "sort 2 1:", "chosen": " 1 2", "rejected": " 2 1", "margin": float("nan")}] * 20
    (tmp_path / "nan.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_script("reward_model.py", "--model-name-or-path", base, "--dataset-name", "nan.jsonl", "--max-steps", "3",
                      "--batch-size", "4", "--output-dir", "rm", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "loss is nan at step 1")
    assert not (tmp_path / "rm").exists()


@pytest.mark.parametrize("script", [rlhf_ppo, dpo, sft])
def test_sampling_draws_from_the_models_own_distribution(tmp_path, script):
    """Bug 2: generation_config.json (repetition_penalty, no_repeat_ngram_size, min_new_tokens, top_k, a
    temperature) leaked into sampling, so the tokens sampled did not come from the distribution whose log-probs PPO
    trains. generate's own loop: greedy, every token is the argmax of one forward pass over prompt + response at its
    position (prompts shared by two rows each, left padding, a row that stops early and leaves the batch); sampled,
    the first token's frequencies over 4,000 rows of one prompt are softmax(logits / 0.7)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generation = dict(do_sample=True, repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=6, top_k=3,
                      temperature=0.3)
    path = save_checkpoint(str(tmp_path / "m"), "llama", "chat_eot", "float32", generation=generation)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    script.add_pad_token(tokenizer, script.stop_token_ids(tokenizer), model)
    pad = tokenizer.pad_token_id
    prompts = [script.encode_prompt(tokenizer, chat(q)) for q, _, _ in sort_rows(6)] * 2
    assert len({len(p) for p in prompts}) > 1  # some rows left-padded
    with torch.no_grad():
        model.lm_head.weight *= 20  # a peaked distribution: the right temperature, and the right position, show
    never = [len(tokenizer) - 1]  # a stop token that greedy sampling does not produce here
    sample = script.generate
    sequences, _, width, _, _ = sample(model, prompts, pad, never, 8, greedy=True)
    stop = [sequences[0, width + 1].item()]  # row 0 stops at its second token; the others go on longer
    steps = []  # the logits of each step after the first, of the rows still running
    model.register_forward_hook(lambda m, args, kwargs, out: steps.append(out.logits[:, -1])
                                if kwargs.get(script.CACHE) is not None and kwargs["input_ids"].shape[1] == 1
                                else None, with_kwargs=True)
    sequences, attention_mask, width, response_mask, _ = sample(model, prompts, pad, stop, 8, greedy=True)
    assert response_mask[0].sum() <= 2 and response_mask.sum(1).max() == 8 and len(steps) == 7
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask,
                       position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, width - 1 : -1]
    valid = response_mask.bool()
    assert (logits.argmax(-1)[valid] == sequences[:, width:][valid]).all()
    for t, step in enumerate(steps, 1):  # step t: the rows with no stop token before t, in their order
        torch.testing.assert_close(step, logits[valid[:, t], t], atol=1e-4, rtol=0)

    torch.manual_seed(0)
    n = 4000
    sequences, _, width, _, _ = sample(model, [prompts[0]] * n, pad, never, 1, temperature=0.7)
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].float() / 0.7, -1)
    assert p.max() < 0.9  # not all on one token
    frequency = torch.bincount(sequences[:, width], minlength=len(p)).float() / n
    assert (frequency - p).abs().max() < 4 * (p * (1 - p) / n).sqrt().max() + 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_every_script_tokenizes_an_example_the_same_way(kind):
    """Bug 3: prompts were tokenized without BOS (Llama/Mistral/Gemma-style models never saw it), with the
    EOS of T5-style tokenizers possible; now the prompt has BOS where the tokenizer prepends one, and SFT,
    the reward model, PPO and DPO see the same token sequence for the same example."""
    from transformers import ByT5Tokenizer

    tokenizer = make_tokenizer(kind)
    stop_ids = sft.stop_token_ids(tokenizer)
    prompt, chosen, rejected = "sort 3 1 2:", " 1 2 3", " 3 2 1"
    ids, labels = sft.tokenize({"prompt": prompt, "completion": chosen}, tokenizer, stop_ids)
    prompt_ids = rlhf_ppo.encode_prompt(tokenizer, prompt)
    for script in (reward_model, dpo):
        p, c, r = script.tokenize_preference(tokenizer, {"prompt": prompt, "chosen": chosen, "rejected": rejected}, stop_ids)
        assert (p, p + c) == (prompt_ids, ids) and r != c
    assert ids[: len(prompt_ids)] == prompt_ids and labels == [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in prompt_ids
    bos = tokenizer.bos_token_id
    assert (prompt_ids[0] == bos) == TOKENIZER_KINDS[kind].get("prepend_bos", False)
    assert prompt_ids.count(bos) <= 1
    # a T5-style tokenizer appends EOS as its special token: never to a prompt
    byt5 = ByT5Tokenizer()
    assert sft.encode_prompt(byt5, "sort 1:") == [byte + 3 for byte in b"sort 1:"]  # ByT5: id = byte + 3, no EOS


def test_conversational_prompts_end_with_the_assistant_header_and_completions_with_end_of_turn():
    """Bugs 4 and 5: conversational rows crashed reward_model/dpo/rlhf_ppo; and a chat model stopped on the
    wrong token. The completion of a conversation ends with the template's end-of-turn token, which is in the
    stop set (and EOS is not appended after it)."""
    tokenizer = make_tokenizer("chat_eot")
    eot, eos = tokenizer.convert_tokens_to_ids("<|eot_id|>"), tokenizer.eos_token_id
    stop_ids = dpo.stop_token_ids(tokenizer)
    assert stop_ids == [eos, eot]
    row = {"prompt": chat("sort 2 1:"), "chosen": [{"role": "assistant", "content": "1 2"}],
           "rejected": [{"role": "assistant", "content": "2 1"}]}
    p, c, r = reward_model.tokenize_preference(tokenizer, row, stop_ids)
    assert tokenizer.decode(p).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tokenizer.decode(p).startswith("<|begin_of_text|>") and p.count(tokenizer.bos_token_id) == 1
    assert c[-1] == eot and r[-1] == eot and tokenizer.decode(c[:-1]) == "1 2"
    # implicit conversational: the shared messages are the prompt
    implicit = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
    assert dpo.tokenize_preference(tokenizer, implicit, stop_ids) == (p, c, r)
    # SFT's messages: the loss ends at the end-of-turn token, not on what the template writes after it
    chatml = make_tokenizer("pad_is_eos")
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    ids, labels = sft.tokenize({"messages": chat("sort 2 1:", "1 2")}, chatml, sft.stop_token_ids(chatml))
    labeled = [t for t in labels if t != -100]
    assert labeled[-1] == im_end and chatml.decode(labeled[:-1]) == "1 2" and ids[-1] != im_end  # a "\n" follows
    # and a conversational completion stops there too: the template's newline after <|im_end|> is never sampled
    _, completion = sft.tokenize_pair(chatml, chat("sort 2 1:"), [{"role": "assistant", "content": "1 2"}],
                                      sft.stop_token_ids(chatml))
    assert completion[-1] == im_end and chatml.decode(completion[:-1]) == "1 2"
    # rlhf_ppo: a conversational prompt is the template with the generation prompt
    assert rlhf_ppo.encode_prompt(tokenizer, row["prompt"]) == p


def test_sampling_and_scoring_stop_at_the_end_of_turn_token():
    """Bug 5: rollouts, the response mask, the reward model's scoring position and the missing-EOS penalty
    used only tokenizer.eos_token; a chat model ends its turn with another token."""
    from transformers import AutoModelForSequenceClassification, GPT2Config

    eot, eos, pad = 7, 2, 0
    stop_ids = [eos, eot]

    class ScriptedCache:  # the prompt each row continues (its last token), and the tokens sampled so far
        def __init__(self, prompts):
            self.prompts, self.steps = prompts, 0

        def batch_select_indices(self, rows):
            self.prompts = self.prompts[rows]

    class ScriptedModel(torch.nn.Module):  # samples these responses, by prompt, at any temperature
        device = torch.device("cpu")
        responses = {4: [5, eot, 9, 9], 6: [5, 6, 6, 6]}

        def forward(self, input_ids, **kwargs):
            past = kwargs.get(script.CACHE)  # the cache under the name the installed transformers uses
            cache = past or ScriptedCache(input_ids[:, -1].clone())
            cache.steps += past is not None
            logits = torch.zeros(len(input_ids), 1, 10)
            for row, prompt in enumerate(cache.prompts.tolist()):
                logits[row, 0, self.responses[prompt][cache.steps]] = 100.0
            return Output(logits=logits, **{script.CACHE: cache})

    class Output(dict):  # a model output: fields by name and by key
        __getattr__ = dict.__getitem__

    for script in (rlhf_ppo, scale_dpo, grpo, dpo):
        sample = script.generate
        sequences, attention_mask, width, mask, _ = sample(ScriptedModel(), [[3, 4], [6]], pad, stop_ids, 4)
        assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # cut after the end-of-turn token
        assert sequences[:, width:].tolist() == [[5, eot, pad, pad], [5, 6, 6, 6]]
        reward = AutoModelForSequenceClassification.from_config(GPT2Config(vocab_size=10, n_embd=8, n_layer=1, n_head=2,
                                                                           num_labels=1, pad_token_id=pad)).eval()
        scorer = script.TokenScorer(reward) if hasattr(script, "TokenScorer") else reward  # scale/: on every token
        scores, has_stop = script.response_scores(scorer, sequences, attention_mask, mask, stop_ids, -7.0)
        assert has_stop.tolist() == [True, False] and scores[1].item() == -7.0
        expected = scale_dpo.scalar_head(reward, sequences[:1, :4], attention_mask[:1, :4])[0, -1]  # at the eot
        assert scores[0].item() == pytest.approx(expected.item(), abs=1e-6)


def test_implicit_text_prompts_end_on_a_whole_token():
    """Bug 4: the shared prompt of implicit pairs is taken on whole tokens: no word split, and its leading space
    stays with the word (character-level common prefixes cut "The ca|t" or leave "Answer: " with its space)."""
    tokenizer = make_tokenizer("eos_no_pad")
    stop_ids = dpo.stop_token_ids(tokenizer)
    for chosen, rejected, prompt in [("The cat sat", "The cap sat", "The"),
                                     ("Question: sort 8 1 9 Answer: 1 8 9", "Question: sort 8 1 9 Answer: 9 8 1",
                                      "Question: sort 8 1 9 Answer:")]:
        p, c, r = dpo.tokenize_preference(tokenizer, {"chosen": chosen, "rejected": rejected}, stop_ids)
        assert tokenizer.decode(p) == prompt
        assert tokenizer.decode(c[:-1]) == chosen[len(prompt) :] and tokenizer.decode(r[:-1]) == rejected[len(prompt) :]
        assert c[-1] == r[-1] == tokenizer.eos_token_id
        assert reward_model.tokenize_preference(tokenizer, {"chosen": chosen, "rejected": rejected}, stop_ids) == (p, c, r)


def test_pairs_that_do_not_fit_or_become_equal_are_dropped_and_counted(tmp_path, capsys):
    """Bug 6: reward_model.py and dpo.py cut prompt+completion to --max-length − 1 and appended EOS: long prompts
    made chosen == rejected (zero gradient, still counted) and a cut completion got a fake EOS."""
    base = save_checkpoint(str(tmp_path / "base"), "gpt_neox", "eos_no_pad", "float32")
    long_prompt = "sort " + " ".join("1234567890" * 4) + ":"
    rows = [{"prompt": f"sort {i} 1:", "chosen": f" 1 {i}", "rejected": f" {i} 1"} for i in range(2, 10)] * 3
    rows += [{"prompt": long_prompt, "chosen": " 1", "rejected": " 2"}] * 10
    rows += [{"prompt": f"sort {i} 1:", "chosen": " 1", "rejected": " 1"} for i in range(5)]  # the same tokens
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for script, extra in (("reward_model.py", []), ("dpo.py", ["--reward-model-path", "None", "--response-length", "4"])):
        run_in_process(script, "--model-name-or-path", base, "--dataset-name", "p.jsonl", "--max-length", "32",
                       "--max-steps", "2", "--batch-size", "4", "--warmup-steps", "1", "--output-dir", script, *extra,
                       cwd=tmp_path)
        out = capsys.readouterr().out
        # 39 rows, 3 held out for eval; of the others, 10 − k are too long and 5 − j have chosen == rejected
        train, held_out = split_rows(tmp_path / "p.jsonl")
        long, same = (sum(r["prompt"] == long_prompt for r in train), sum(r["chosen"] == r["rejected"] for r in train))
        assert f"train: dropped {long} of 36 pairs longer than --max-length 32 (the longest: " in out
        assert f"tokens), {same} whose chosen and rejected are the same" in out and long > 5 and same > 2
        assert ("eval: dropped" in out) == (long + same < 15), out


def test_sft_reports_dropped_examples_and_stops_when_none_fits(tmp_path):
    """Bug 6: sft.py logged `train/loss nan` and crashed in eval when all labels of a batch were cut away."""
    base = save_checkpoint(str(tmp_path / "base"), "gpt2", "eos_no_pad", "float32")
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    proc = run_script("sft.py", "--model-name-or-path", base, "--dataset-name", data, "--max-length", "4",
                      cwd=tmp_path, check=False)
    assert_one_line_error(proc, "no training example fits --max-length 4")
    proc = run_script("sft.py", "--model-name-or-path", base, "--dataset-name", data, "--max-length", "12",
                      "--max-steps", "2", "--batch-size", "4", "--eval-every", "2", "--output-dir", "out", cwd=tmp_path)
    assert "train: dropped" in proc.stdout and "nan" not in proc.stdout


def test_a_template_that_rerenders_earlier_turns_is_refused():
    """Bug 7: with a template that renders earlier turns differently once later turns exist (as templates that
    strip past reasoning do), the messages format put the labels on the wrong tokens without a word."""
    tokenizer = make_tokenizer("pad_is_eos")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
                               "not loop.last %}(earlier reply){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = chat("sort 2 1:", "1 2") + chat("and 3 1?", "1 3")
    with pytest.raises(SystemExit, match="renders earlier turns differently"):
        sft.tokenize({"messages": messages}, tokenizer, sft.stop_token_ids(tokenizer))
    sft.tokenize({"messages": messages[:2]}, tokenizer, sft.stop_token_ids(tokenizer))  # one turn is fine


def test_eval_score_is_the_same_quantity_in_rlhf_ppo_and_dpo(tiny_checkpoints, tmp_path):
    """Bug 8: rlhf_ppo.py's eval/score applied the missing-EOS penalty and dpo.py's did not, yet the two were
    compared side by side. With one-token responses nearly nothing ends (the SFT model rarely puts its EOS
    first), so both must log exactly the penalty at their first evaluation, of the same SFT model. (After an
    update the first token is sometimes the EOS: one in 16 on CUDA, so later evaluations are not asserted.)"""
    models = tiny_checkpoints["cwd"] / "models"
    common = ["--response-length", "1", "--missing-eos-penalty", "-7", "--eval-size", "16", "--output-dir", "out"]
    run_in_process("rlhf_ppo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path",
                   str(models / "reward_model"), "--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "8",
                   *common, cwd=tmp_path)
    run_in_process("dpo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path",
                   str(models / "reward_model"), "--max-steps", "1", "--batch-size", "4", "--num-train-pairs", "8",
                   *common, cwd=tmp_path)
    for name in ("rlhf_ppo", "dpo"):
        scalars = read_scalars(str(next((tmp_path / "runs").glob(f"{name}__*"))))
        assert len(scalars["eval/score"]) == 2 and scalars["eval/score"][0][1] == -7.0, name


def test_dropout_is_off_also_where_it_is_a_config_number(tmp_path):
    """Bug 9: dropout was off only for nn.Dropout modules; Llama/Qwen2 attention dropout is a number each layer
    reads from the config, so the policy's and reward model's outputs were random in train mode. GPT-2 names its
    three `*_pdrop`. In both tiers."""
    from transformers import AutoModelForSequenceClassification

    for arch, dropout in (("llama", {"attention_dropout": 0.5}), ("qwen2", {"attention_dropout": 0.5}),
                          ("gpt2", {"resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5})):
        base = save_checkpoint(str(tmp_path / arch), arch, "bos", "float32", **dropout)
        rm_path = str(tmp_path / f"{arch}_rm")
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(rm_path)
        make_tokenizer("bos").save_pretrained(rm_path)
        tokenizer = dpo.load_tokenizer(base, "")
        # what dpo, rlhf_ppo and grpo load as the policy and the critic, and reward_model.py as the model it trains
        policy = dpo.load_no_dropout(base, "lm")
        actor = grpo.load_no_dropout(base, "lm")
        critic = rlhf_ppo.load_no_dropout(rm_path, "score")
        trained_rm = reward_model.load_no_dropout(rm_path, "score")
        # and scale/'s: its four files load these models through one text of load_config (tests/test_copies.py)
        scale_policy = scale_dpo.load_no_dropout(base, "lm", torch.float32, scale_dpo.load_config(base, "lm"))
        scale_critic = scale_dpo.load_no_dropout(rm_path, "score", torch.float32, scale_dpo.load_config(rm_path, "score"))
        ids = torch.tensor([tokenizer("sort 3 1 2: 1 2 3")["input_ids"] * 4])
        for model in (policy, actor, critic, trained_rm, scale_policy, scale_critic):
            model.train()
            outputs = [model(input_ids=ids).logits for _ in range(2)]
            assert torch.equal(*outputs), (arch, type(model).__name__)
    # and what main loads: the update runs in train mode, so its first ratio is exactly 1 only without dropout
    prompts = write_data(tmp_path / "prompts.jsonl", "text_prompts")
    base, rm_path = str(tmp_path / "llama"), str(tmp_path / "llama_rm")
    common = ["--model-name-or-path", base, "--reward-model-path", rm_path, "--dataset-name", prompts, "--num-iterations",
              "1", "--batch-size", "8", "--mini-batch-size", "8", "--response-length", "4", "--eval-size", "2"]
    run_in_process("rlhf_ppo.py", *common, "--output-dir", "ppo", cwd=tmp_path)
    run_in_process("grpo.py", *common, "--num-generations", "4", "--output-dir", "grpo", cwd=tmp_path)
    for name in ("rlhf_ppo", "grpo"):
        scalars = read_scalars(str(next((tmp_path / "runs").glob(f"{name}__*"))))
        assert scalars["policy/first_ratio_max_error"] == [(1, 0.0)], name


def test_get_lr_by_hand():
    """Bug 9: --warmup-steps 0 and warmup == max steps divided by zero."""
    for script in LM_SCRIPTS:
        # warmup 2 of 10 steps, peak 1: steps 0, 1 → 1/2, 2/2; then linear (10 − s)/8: step 2 → 1, 6 → 0.5, 10 → 0
        assert [script.get_lr(s, 1.0, 2, 10, "linear") for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
        # cosine over the whole run, times the warmup: step 4 of 10: ½(1 + cos 0.4π) = ½(1 + 0.309017) = 0.654508;
        #   step 5: ½(1 + cos π/2) = 0.5; step 0: warmup ½ × ½(1 + cos 0) = 0.5
        assert script.get_lr(4, 1.0, 2, 10, "cosine") == pytest.approx(0.654508, abs=1e-6)
        assert script.get_lr(5, 1.0, 2, 10, "cosine") == pytest.approx(0.5)
        assert script.get_lr(0, 1.0, 2, 10, "cosine") == pytest.approx(0.5)
        assert script.get_lr(0, 3.0, 0, 4, "linear") == 3.0  # no warmup: the peak at once, then (4 − 1)/4 · 3
        assert script.get_lr(1, 3.0, 0, 4, "linear") == pytest.approx(2.25)
        assert script.get_lr(4, 1.0, 5, 5, "linear") == 1.0  # warmup == max steps: warms up to the end


def bf16_copies(tiny_checkpoints, root):
    """{name: path} of copies of the tiny checkpoints saved in bfloat16 (weights and config.json), as a hub
    checkpoint often is. The scripts train them in float32 all the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    copies = {}
    for name in ("sft", "reward_model"):
        copies[name] = shutil.copytree(tiny_checkpoints[name], os.path.join(root, f"{name}_bf16"))
        weights = os.path.join(copies[name], "model.safetensors")
        save_file({k: v.bfloat16() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
        with open(os.path.join(copies[name], "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(copies[name], "config.json"), "w") as f:
            json.dump({**config, "dtype": "bfloat16"}, f)
    return copies


def model_flags(script, tiny_checkpoints):
    """The checkpoints a short run of `script` ("grpo", "grpo.py" or "scale/grpo.py") starts from: sft.py builds its
    own tiny model."""
    return {"sft": [], "reward_model": ["--model-name-or-path", str(tiny_checkpoints["sft"])],
            "dpo": ["--model-name-or-path", str(tiny_checkpoints["sft"])],
            "kto": ["--model-name-or-path", str(tiny_checkpoints["sft"])],
            "rlhf_ppo": ["--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                         str(tiny_checkpoints["reward_model"])],
            "grpo": ["--model-name-or-path", str(tiny_checkpoints["sft"])]}[os.path.basename(script).removesuffix(".py")]


# (script, flags, the learning rate of each optimizer step worked out by hand, × 2e-3); every step clips to 0.5
# and decays the weights by WEIGHT_DECAY[script]
SCHEDULES = [
    # warmup 2 of 4 steps, times cosine over the run: ½ · 1, ½(1 + cos π/4), ½(1 + cos π/2), ½(1 + cos 3π/4)
    ("sft", ["--max-steps", "4", "--warmup-steps", "2", "--num-train-examples", "64", "--weight-decay", "0.03",
             *TINY_LM], [0.5, 0.853553, 0.5, 0.146447]),
    # warmup 2 of 4 steps, flat through it, then linear to 0 at step 4: ½, 1, (4 − 2)/2, (4 − 3)/2
    ("reward_model", ["--max-steps", "4", "--warmup-steps", "2", "--num-train-pairs", "64", "--weight-decay", "0.03"],
     [0.5, 1.0, 1.0, 0.5]),
    ("dpo", ["--max-steps", "4", "--warmup-steps", "2", "--num-train-pairs", "64"], [0.5, 1.0, 1.0, 0.5]),
    # --anneal-lr: linear over 2 iterations from the peak, (2 − 0)/2 then (2 − 1)/2, for both minibatches of each
    ("rlhf_ppo", ["--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "1"],
     [1.0, 1.0, 0.5, 0.5]),
    ("grpo", ["--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "1",
              "--num-generations", "4"], [1.0, 1.0, 0.5, 0.5]),
    ("grpo", ["--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "1",
              "--num-generations", "4", "--no-anneal-lr"], [1.0, 1.0, 1.0, 1.0]),
]
# --weight-decay where a script has the flag; dpo.py decays none; rlhf_ppo.py and grpo.py take AdamW's default, 0.01
WEIGHT_DECAY = {"sft": 0.03, "reward_model": 0.03, "dpo": 0.0, "rlhf_ppo": 0.01, "grpo": 0.01}


@pytest.mark.parametrize("tier", ["", "scale/"], ids=["top_level", "scale"])
@pytest.mark.parametrize("script,flags,by_hand", SCHEDULES, ids=["sft", "reward_model", "dpo", "rlhf_ppo", "grpo",
                                                                 "grpo_no_anneal"])
def test_each_optimizer_step_takes_the_scheduled_learning_rate_and_clip(tier, script, flags, by_hand, tiny_checkpoints,
                                                                        tmp_path, monkeypatch):
    """main hands the schedule its flags and the optimizer what it returns: the learning rate of every optimizer
    step, read from the optimizer as the step is taken, its weight decay, and the norm each gradient is clipped to,
    against the schedules worked out by hand (SCHEDULES). A loop that ignores --lr (2e-3 here, no script's
    default), --warmup-steps, --max-steps, --anneal-lr, --weight-decay or --max-grad-norm, or never gives the
    optimizer the scheduled rate, fails. In both tiers: tests/test_tiers.py runs most of these flags at their
    defaults, where a flag replaced by its default cannot show. The runs start from bfloat16 copies of the
    checkpoints, and with no --save-dtype main saves the trained model in its checkpoint's dtype, bfloat16
    (float32 for sft.py's model built from scratch): a main that asks save_dtype_of about no checkpoint saves
    float32, twice the size."""
    seen, real_step, real_clip = ({"lr": [], "weight_decay": [], "max_norm": []}, torch.optim.AdamW.step,
                                  torch.nn.utils.clip_grad_norm_)

    def step_spy(self, *args, **kwargs):
        seen["lr"].append(self.param_groups[0]["lr"])
        seen["weight_decay"].append(self.param_groups[0]["weight_decay"])
        return real_step(self, *args, **kwargs)

    def clip_spy(parameters, max_norm, *args, **kwargs):
        seen["max_norm"].append(max_norm)
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_spy)
    run_in_process(f"{tier}{script}.py", *model_flags(script, bf16_copies(tiny_checkpoints, str(tmp_path))), *flags,
                   "--lr", "2e-3", "--max-grad-norm", "0.5", "--eval-size", "4", "--output-dir", "out", cwd=tmp_path)
    assert seen["lr"] == pytest.approx([2e-3 * lr for lr in by_hand], rel=1e-5)
    assert seen["weight_decay"] == [WEIGHT_DECAY[script]] * len(by_hand)
    assert seen["max_norm"] == [0.5] * len(by_hand)
    from safetensors import safe_open

    saved = "float32" if script == "sft" else "bfloat16"
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == saved
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, saved)}


# (script, flags, whether it samples): short runs of every LM script in both tiers, evaluation included
KV_CACHE_RUNS = [(f"{tier}{script}.py", flags, samples) for tier in ("", "scale/") for script, flags, samples in [
    ("sft", [*TINY_LM, "--max-steps", "2", "--eval-every", "2", "--num-train-examples", "64"], True),
    ("reward_model", ["--max-steps", "2", "--eval-every", "2", "--num-train-pairs", "64"], False),
    ("dpo", ["--max-steps", "2", "--eval-every", "2", "--num-train-pairs", "64"], True),
    ("rlhf_ppo", ["--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "4"], True),
    ("grpo", ["--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "4", "--num-generations", "4"], True)]]


@pytest.mark.parametrize("script,flags,samples", KV_CACHE_RUNS, ids=[run[0] for run in KV_CACHE_RUNS])
def test_only_sampling_keeps_a_kv_cache(script, flags, samples, tiny_checkpoints, tmp_path, monkeypatch):
    """Every forward pass of the model says whether it keeps a KV cache: transformers' default (config.use_cache,
    on for GPT-2, Qwen, Llama) builds one in every pass and copies each layer's keys and values into it, work and
    memory that only sampling uses. So training, the rollout's log-probs, values and scores and the evaluation's
    losses pass use_cache=False, as TRL's trainers do, and sampling use_cache=True. A pass that leaves it to the
    config fails."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model

    seen, real_forward = [], GPT2Model.forward

    def forward_spy(self, *args, **kwargs):
        seen.append(kwargs.get("use_cache"))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT2Model, "forward", forward_spy)
    run_in_process(script, *CPU_FLOAT32, *model_flags(script, tiny_checkpoints), *flags, "--eval-size", "4",
                   "--output-dir", "out", cwd=tmp_path)
    assert None not in seen and False in seen and (True in seen) == samples, sorted(set(map(str, seen)))


@pytest.mark.parametrize("script,flags,samples", KV_CACHE_RUNS, ids=[run[0] for run in KV_CACHE_RUNS])
def test_bf16_computes_the_passes_that_train_in_bfloat16(script, flags, samples, tiny_checkpoints, tmp_path):
    """--bf16 is mixed precision on the CPU as on a GPU: autocast computes the forward passes that train in
    bfloat16 over float32 weights, which are trained and saved in float32. The dtype of each module's output in a
    pass with gradients is read from a hook on every module. A script that drops the flag trains in float32 and
    fails (the other bf16 tests read values that float32 gives too: a KL of exactly 0, float32 weights)."""
    seen = set()

    def hook(module, args, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.is_floating_point():
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        run_in_process(script, "--no-cuda", "--bf16", *model_flags(script, tiny_checkpoints), *flags, "--eval-size", "4",
                       "--output-dir", "out", cwd=tmp_path)
    finally:
        handle.remove()
    assert torch.bfloat16 in seen, seen
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("script,flags,samples", KV_CACHE_RUNS, ids=[run[0] for run in KV_CACHE_RUNS])
def test_a_nan_gradient_norm_stops_every_script_before_its_optimizer_step(script, flags, samples, tiny_checkpoints,
                                                                          tmp_path, monkeypatch):
    """Every LM main, in both tiers, checks each update's loss and gradient norm before the optimizer steps: with
    the norm that clip_grad_norm_ returns made NaN (the gradients left as they are), the run stops at its first
    update with one line that names it, the optimizer never steps, and no model is saved. A main that drops its
    check_finite call trains on and saves. (test_a_nan_loss_stops_the_run_with_one_line_and_saves_nothing makes
    the loss itself NaN, in sft.py and reward_model.py.)"""
    stepped, real_clip = [], torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *args, **kwargs: real_clip(*args, **kwargs) * math.nan)
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *args, **kwargs: stepped.append(self))
    message = one_line_exit(script, *CPU_FLOAT32, *model_flags(script, tiny_checkpoints), *flags, "--eval-size", "4",
                            "--output-dir", "out", cwd=tmp_path)
    assert "grad_norm is nan at step 1; stopped, nothing saved" in message, message
    assert not stepped
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_finite_stops_on_nan_and_on_inf(value):
    """check_finite, one text in the ten LM mains: a loss or a gradient norm that is NaN, or infinite either way,
    stops the run with one line naming it and the step; finite values (a tensor or a float) pass."""
    sft.check_finite(3, loss=torch.tensor(0.5), grad_norm=2.0)
    with pytest.raises(SystemExit) as stop:
        sft.check_finite(3, loss=torch.tensor(0.5), grad_norm=torch.tensor(value))
    assert str(stop.value.code).startswith(f"error: grad_norm is {value} at step 3; stopped, nothing saved")


# The counts each LM main takes, with the least each can be (--warmup-steps 0: none; --eval-size 0: no evaluation).
# Below it, a run crashed deep inside (a modulo by zero, an empty batch, a tensor of negative size) or trained for no
# step and saved
COUNTS = {"sft": {"max-steps": 1, "batch-size": 1, "warmup-steps": 0, "eval-every": 1, "eval-size": 0,
                  "max-new-tokens": 1, "num-train-examples": 1, "n-layer": 1, "n-embd": 1, "n-head": 1},
          "reward_model": {"max-steps": 1, "batch-size": 1, "warmup-steps": 0, "eval-every": 1, "eval-size": 0,
                           "num-train-pairs": 1},
          "dpo": {"max-steps": 1, "batch-size": 1, "warmup-steps": 0, "eval-every": 1, "eval-size": 0,
                  "response-length": 1, "num-train-pairs": 1},
          "rlhf_ppo": {"num-iterations": 1, "batch-size": 1, "mini-batch-size": 1, "ppo-epochs": 1,
                       "response-length": 1, "kl-horizon": 1, "eval-every": 1, "eval-size": 0},
          "grpo": {"num-iterations": 1, "num-generations": 2, "batch-size": 1, "mini-batch-size": 1, "ppo-epochs": 1,
                   "max-sampling-rounds": 1, "response-length": 1, "eval-every": 1, "eval-size": 0}}
ACCUMULATE = {"gradient-accumulation-steps": 1}
SCALE_COUNTS = {"sft": ACCUMULATE, "reward_model": ACCUMULATE, "dpo": ACCUMULATE,  # and scale/'s own
                "rlhf_ppo": {**ACCUMULATE, "generation-batch-size": 1, "value-warmup-steps": 0},  # VC-PPO's: scale/'s
                "grpo": {**ACCUMULATE, "generation-batch-size": 1}}
COUNT_CASES = [(f"{tier}{script}.py", flag, least) for tier in ("", "scale/") for script in COUNTS
               for flag, least in (COUNTS[script] | (SCALE_COUNTS[script] if tier else {})).items()]


@pytest.mark.parametrize("script,flag,least", COUNT_CASES, ids=[f"{s}:{f}" for s, f, _ in COUNT_CASES])
def test_a_count_below_its_least_is_one_line_before_any_model_is_loaded(script, flag, least, tmp_path):
    """Each count of each LM main, in both tiers, one below the least it can be: one line that names the flag, its
    value and the least, before anything is loaded (the model path does not exist, so a check made after loading
    would stop with another line) or written. A main that skips check_args, or a count left out of it, fails."""
    path = ["--model-name-or-path", "models/none"]
    # sft.py builds its model: a short run, so that a main that misses the check trains for seconds, not minutes
    short = {"max-steps": 1, "batch-size": 8, "num-train-examples": 16, "eval-size": 4, "n-layer": 1, "n-embd": 32}
    flags = path if "sft" not in script else [f for k, v in short.items() if k != flag for f in (f"--{k}", str(v))]
    message = one_line_exit(script, *flags, f"--{flag}", str(least - 1), cwd=tmp_path)
    assert message == f"error: --{flag} {least - 1}: it must be at least {least}", message
    assert not os.listdir(tmp_path)


# The real-valued flags each LM main (both tiers) checks: finite, and > 0 or >= 0. A gradient clip of 0 scales every
# gradient to 0 (the run trains nothing) and one below 0 turns it round; a temperature of 0 divided by zero; a
# negative --lr or a NaN reached AdamW's own check, a traceback
RULES = {"sft": {"lr": ">= 0", "weight-decay": ">= 0", "max-grad-norm": "> 0"},
         "reward_model": {"lr": ">= 0", "weight-decay": ">= 0", "max-grad-norm": "> 0",
                          "center-rewards-coefficient": ">= 0"},
         "dpo": {"lr": ">= 0", "max-grad-norm": "> 0", "beta": "> 0", "temperature": "> 0"},
         "rlhf_ppo": {"lr": ">= 0", "max-grad-norm": "> 0", "temperature": "> 0", "kl-coef": ">= 0", "kl-target": "> 0",
                      "cliprange": "> 0", "cliprange-value": "> 0", "vf-coef": ">= 0"},
         "grpo": {"lr": ">= 0", "max-grad-norm": "> 0", "temperature": "> 0", "beta": ">= 0", "epsilon": "> 0",
                  "epsilon-high": "> 0"}}
SCALE_RULES = {"rlhf_ppo": {"cliprange-high": "> 0", "length-adaptive-lam": "> 0", "positive-lm-coef": ">= 0"}}  # VAPO's
RULE_CASES = [(f"{tier}{script}.py", flag, rule, value) for tier in ("", "scale/") for script, rules in RULES.items()
              for flag, rule in (rules | (SCALE_RULES.get(script, {}) if tier else {})).items()
              for value in ({"> 0": "0.0", ">= 0": "-0.5"}[rule], "nan")]


@pytest.mark.parametrize("script,flag,rule,value", RULE_CASES, ids=[f"{s}:{f}={v}" for s, f, _, v in RULE_CASES])
def test_a_number_out_of_its_range_is_one_line_before_any_model_is_loaded(script, flag, rule, value, tmp_path):
    """Each real-valued flag of each LM main just out of its range, and NaN: one line that names the flag, its value
    and the range, before anything is loaded (the model path does not exist) or written. A main that skips the
    check, or a flag left out of it, fails."""
    path = ["--model-name-or-path", "models/none"]
    short = {"max-steps": 1, "batch-size": 8, "num-train-examples": 16, "eval-size": 4, "n-layer": 1, "n-embd": 32}
    flags = path if "sft" not in script else [f for k, v in short.items() for f in (f"--{k}", str(v))]
    message = one_line_exit(script, *flags, f"--{flag}", value, cwd=tmp_path)
    assert message == f"error: --{flag} {float(value)}: it must be a finite number {rule}", message
    assert not os.listdir(tmp_path)


# The flags held to an interval: γ and λ in [0, 1] (a discount above 1 grows the far rewards, below 0 flips them
# term by term); DPO's label smoothing, the chance a label is flipped, in [0, 0.5] (above it the preference turns
# round). A reward or a score of either sign, finite: the missing-EOS penalty and the reward weights (NaN or inf
# ran before, and stopped only at the first loss, after the models were loaded, or in dpo.py not at all)
INTERVAL_CASES = [("scale/rlhf_ppo.py", ["--critic-lam", "1.5"], "--critic-lam 1.5: it must be in [0, 1]"),  # VC-PPO's
                  ("scale/rlhf_ppo.py", ["--actor-lam", "-0.1"], "--actor-lam -0.1: it must be in [0, 1]")] + [
    (f"{tier}{script}.py", flags, message) for tier in ("", "scale/") for script, flags, message in [
    ("rlhf_ppo", ["--gamma", "-0.5"], "--gamma -0.5: it must be in [0, 1]"),
    ("rlhf_ppo", ["--lam", "1.5"], "--lam 1.5: it must be in [0, 1]"),
    ("rlhf_ppo", ["--gamma", "nan"], "--gamma nan: it must be in [0, 1]"),
    ("dpo", ["--label-smoothing", "-0.1"], "--label-smoothing -0.1: it must be in [0, 0.5]"),
    ("dpo", ["--label-smoothing", "0.6"], "--label-smoothing 0.6: it must be in [0, 0.5]"),
    ("dpo", ["--label-smoothing", "nan"], "--label-smoothing nan: it must be in [0, 0.5]"),
    ("dpo", ["--missing-eos-penalty", "inf"], "--missing-eos-penalty inf: it must be a finite number"),
    ("rlhf_ppo", ["--missing-eos-penalty", "nan"], "--missing-eos-penalty nan, --reward-weights []: each must be a "
                                                   "finite number"),
    ("rlhf_ppo", ["--reward-weights", "-inf"], "--missing-eos-penalty -3.0, --reward-weights [-inf]: each must be a "
                                               "finite number"),
    ("grpo", ["--missing-eos-penalty", "-inf"], "--missing-eos-penalty -inf, --reward-weights []: each must be a "
                                                "finite number"),
    ("grpo", ["--reward-fn", "gold", "--reward-weights", "nan"], "--missing-eos-penalty -1.0, --reward-weights [nan]: "
                                                                 "each must be a finite number")]]


@pytest.mark.parametrize("script,flags,message", INTERVAL_CASES, ids=[f"{s}:{' '.join(f)}" for s, f, _ in INTERVAL_CASES])
def test_a_number_out_of_its_interval_is_one_line_before_any_model_is_loaded(script, flags, message, tmp_path):
    """Below the interval, above it, and NaN: one line, before anything is loaded (the model path does not exist)
    or written."""
    path = ["--model-name-or-path", "models/none"]
    assert one_line_exit(script, *path, *flags, cwd=tmp_path) == f"error: {message}"
    assert not os.listdir(tmp_path)


def test_with_no_test_split_a_tenth_at_most_is_held_out_at_random(tmp_path):
    """load_data, one text in the eleven LM mains: a dataset with no `test` split holds out --eval-size rows drawn
    at random with --seed, never more than a tenth, so that a small dataset still trains on most of its rows and a
    sorted file's first rows (the README's example: every `0+b` prompt first) are not all the evaluation sees;
    the rest, in file order, is the training set. A `test` split is evaluated on up to --eval-size rows."""
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(400)))
    rows = [f"p{i}" for i in range(400)]
    for eval_size, seed, held_out in ((512, 1, 40), (20, 1, 20), (20, 2, 20), (0, 1, 0)):
        train, evals = (list(r["prompt"] for r in part) for part in split_rows(tmp_path / "rows.jsonl", eval_size, seed))
        assert len(evals) == held_out and sorted(evals + train, key=rows.index) == rows and train == sorted(train, key=rows.index)
        assert [r["prompt"] for r in split_rows(tmp_path / "rows.jsonl", eval_size, seed)[1]] == evals  # one seed
        if evals:  # drawn from the whole file, not its start
            assert max(rows.index(p) for p in evals) > 200 and evals != rows[:held_out]
    assert split_rows(tmp_path / "rows.jsonl", 20, 1)[1] != split_rows(tmp_path / "rows.jsonl", 20, 2)[1]
    # with a `test` split, that split is the eval set, its first --eval-size rows, and `train` is trained on whole
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": f"p{i}"} for i in range(40)]),
                          "test": datasets.Dataset.from_list([{"prompt": f"t{i}"} for i in range(30)])}
                         ).save_to_disk(str(tmp_path / "splits"))
    train, evals = split_rows(tmp_path / "splits", 20)
    assert len(train) == 40 and [row["prompt"] for row in evals] == [f"t{i}" for i in range(20)]


@pytest.mark.parametrize("script", [f"{tier}{name}" for tier in ("", "scale.") for name in
                                    ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo")])
def test_load_data_reads_the_config_and_split_asked(script, tmp_path):
    """--dataset-config and --dataset-split reach the loader through load_data, the one text every LM script's main
    hands its flags to: a local dataset repository with two configs (gsm8k has "main" and "socratic"), each with a
    `train` and an `extra` split, every row saying where it comes from. The rows read, train and held out, are
    those of the config and split asked; a loader that takes the first config, or `train`, fails."""
    import importlib
    from types import SimpleNamespace

    repo = tmp_path / "repo"
    configs = "".join(f"- config_name: {config}\n  data_files:\n" + "".join(
        f"  - split: {split}\n    path: {config}/{split}.jsonl\n" for split in ("train", "extra"))
        for config in ("main", "socratic"))
    for config in ("main", "socratic"):
        (repo / config).mkdir(parents=True)
        for split in ("train", "extra"):
            (repo / config / f"{split}.jsonl").write_text("".join(json.dumps(
                {"prompt": f"q{i}", "completion": f"{config}/{split}", "chosen": "a", "rejected": "b"}) + "\n"
                for i in range(20)))
    (repo / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    module = importlib.import_module(script)
    args = SimpleNamespace(dataset_name=str(repo), dataset_config="socratic", dataset_split="extra", eval_size=2, seed=1)
    train, evals = module.load_data(args, None, 10, [("prompt",)], "needs a prompt")
    assert len(train) == 18 and len(evals) == 2  # no `test` split: a tenth at most held out
    assert {row["completion"] for row in train + evals} == {"socratic/extra"}


# (script, flags, the training rows of the built-in task it makes, their kind, the sampling flags and the
# (max_new_tokens, temperature) every sampling call must take): sft.py, reward_model.py and dpo.py take the number
# of rows from a flag, rlhf_ppo.py and grpo.py draw their prompts from a fixed 50,000; each runs 3 steps or
# iterations, evaluating every 2
TASK_SIZES = [(f"{tier}{script}.py", flags, n, row, sampling) for tier in ("", "scale/")
              for script, flags, n, row, sampling in [
    ("sft", [*TINY_LM, "--num-train-examples", "40", "--max-steps", "3", "--max-new-tokens", "5"], 40,
     "demonstration_row", (5, 1.0)),
    ("reward_model", ["--num-train-pairs", "40", "--max-steps", "3"], 40, "preference_row", None),
    ("dpo", ["--num-train-pairs", "40", "--max-steps", "3", "--response-length", "5", "--temperature", "0.7"], 40,
     "preference_row", (5, 0.7)),
    ("rlhf_ppo", ["--num-iterations", "3", "--mini-batch-size", "4", "--response-length", "5", "--temperature", "0.7"],
     50_000, "prompt_row", (5, 0.7)),
    ("grpo", ["--num-iterations", "3", "--mini-batch-size", "4", "--num-generations", "4", "--response-length", "5",
              "--temperature", "0.7"], 50_000, "prompt_row", (5, 0.7))]]


@pytest.mark.parametrize("script,flags,n,row,sampling", TASK_SIZES, ids=[run[0] for run in TASK_SIZES])
def test_the_task_seeds_evaluations_and_run_name_follow_the_flags(script, flags, n, row, sampling, tiny_checkpoints,
                                                                  tmp_path, monkeypatch):
    """What main makes of the flags that shape its data, its random streams, its evaluations and its logs, read
    where main uses them. --num-train-examples (sft.py) and --num-train-pairs (reward_model.py, dpo.py) set how
    many training rows of the built-in task main makes, --eval-size how many eval rows; --seed the random stream
    they come from, the seeds of python's generator (the data order) and torch's (a new model's weights, the
    sampling; rank 0's under scale/) and the generator that draws rlhf_ppo.py's and grpo.py's prompts; every call
    to the task's row maker, the two seed functions and random.Random is read. --eval-every sets the steps that
    log eval/ scalars (every 2nd and the last; the policy scripts also step 0, the untrained policy), --exp-name
    the run directory runs/<exp>__<output>__<seed>__<time>, and the evaluation's --max-new-tokens (sft.py),
    --response-length and --temperature (dpo.py; the rollouts too in rlhf_ppo.py and grpo.py) every call to the
    sampler. A script that takes a default instead (100,000 rows, 512 eval rows, seed 1, 12 tokens, ...) fails."""
    import importlib
    import random

    from conftest import module_name, only_run_dir

    module, made, seeds, sampled = importlib.import_module(module_name(script)), [], [], []
    real_task_rows, real_manual_seed, real_seed = module.task_rows, torch.manual_seed, random.seed

    class Random(random.Random):
        def __init__(self, x=None):
            if isinstance(x, int):  # not the task's streams (strings) nor the unseeded ones of other libraries
                seeds.append(("Random", x))
            super().__init__(x)

    monkeypatch.setattr(module, "task_rows", lambda seed, split, size, task_row: made.append(
        (seed, split, size, task_row.__name__)) or real_task_rows(seed, split, size, task_row))
    monkeypatch.setattr(torch, "manual_seed", lambda seed: seeds.append(("torch", seed)) or real_manual_seed(seed))
    monkeypatch.setattr(random, "seed", lambda seed=None, *args: seeds.append(("python", seed)) or real_seed(seed, *args))
    monkeypatch.setattr(random, "Random", Random)
    sampler = "generate"
    if sampling is not None:
        real_sampler = getattr(module, sampler)
        monkeypatch.setattr(module, sampler, lambda model, prompt_ids, pad, stop_ids, max_new_tokens, temperature=1.0,
                            **kw: sampled.append((max_new_tokens, temperature)) or real_sampler(
                                model, prompt_ids, pad, stop_ids, max_new_tokens, temperature, **kw))
    run_in_process(script, *CPU_FLOAT32, *model_flags(script, tiny_checkpoints), *flags, "--batch-size", "8",
                   "--eval-size", "6", "--seed", "3", "--eval-every", "2", "--exp-name", "named", "--output-dir", "out",
                   cwd=tmp_path)
    assert made[:2] == [(3, "train", n, row), (3, "eval", 6, row)], made
    assert all(seed == 3 and split == "eval" and size == 6 for seed, split, size, _ in made[2:]), made  # dpo's prompts
    assert ("python", 3) in seeds and ("torch", 3) in seeds, seeds
    if n == 50_000:  # the prompts drawn each iteration
        assert ("Random", 3) in seeds and ("Random", 1) not in seeds, seeds
    run_dir = only_run_dir(tmp_path)
    assert os.path.basename(run_dir).startswith("named__out__3__"), run_dir  # <exp>__<output>__<seed>__<time>
    scalars = read_scalars(run_dir)
    evaluated = {step for tag, values in scalars.items() if tag.startswith("eval/") for step, _ in values}
    assert evaluated == {2, 3} | ({0} if os.path.basename(script) in ("dpo.py", "rlhf_ppo.py", "grpo.py") else set())
    if sampling is not None:
        assert sampled and set(sampled) == {sampling}, sampled


def test_long_responses_fit_the_built_in_model_and_too_long_ones_say_so(tiny_checkpoints, tmp_path):
    """Bug 9: the built-in GPT-2's position table was --max-length (64), so rlhf_ppo.py --response-length 60 died
    with an IndexError; it now has 256 positions, and a request beyond the model's positions is one line."""
    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
             "--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "8", "--eval-size", "8"]
    run_in_process("rlhf_ppo.py", *flags, "--response-length", "60", cwd=tmp_path)
    proc = run_script("rlhf_ppo.py", *flags, "--response-length", "300", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "exceeds the model's 256 positions")


def test_mixed_margins_and_held_out_prompts(tiny_checkpoints, tmp_path):
    """Bug 9: mixed None/number margins crashed reward_model.py; rlhf_ppo.py with no test split evaluated on
    its training prompts."""
    rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}",
             "margin": 0.5 if i % 2 else None} for i in range(1, 9)] * 3
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("reward_model.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name",
                   "prefs.jsonl", "--max-steps", "2", "--batch-size", "4", "--output-dir", "rm", cwd=tmp_path)
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"sort {i}:"}) for i in range(100)))
    train, evals = rlhf_ppo.load_data(rlhf_ppo.Args(dataset_name=str(tmp_path / "prompts.jsonl")), "prompt", 50_000,
                                      [("prompt",)], "needs a `prompt` column")
    train, evals = [row["prompt"] for row in train], [row["prompt"] for row in evals]
    assert len(evals) == 10 and not set(train) & set(evals) and len(train) == 90


def test_prepare_models_freezes_only_the_frozen_ones():
    """prepare_models (one text in the LM scripts): every model learns the pad id; the frozen ones (a reference, a
    reward model) go to eval mode with no parameter that asks for a gradient, so nothing can train them or keep
    their activations for a backward pass; the trained one is left as it was."""
    tokenizer = make_tokenizer("pad_is_eos")
    policy, ref = make_model("llama", 384), make_model("llama", 384)
    dpo.prepare_models(tokenizer, dpo.stop_token_ids(tokenizer), [policy, ref], [ref])
    assert policy.config.pad_token_id == ref.config.pad_token_id == tokenizer.pad_token_id is not None
    assert policy.training and all(p.requires_grad for p in policy.parameters())
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_pad_token_reuses_an_unused_special_token_and_never_shrinks_the_vocabulary():
    """Bug 9: adding a pad token resized the embeddings to len(tokenizer), shrinking a vocabulary padded to a
    multiple of 64 (Qwen) or growing it to an unaligned size, where the tokenizer had an unused token to reuse."""
    for script in (sft, reward_model, dpo, rlhf_ppo):
        llama3 = make_tokenizer("chat_eot")  # has <|finetune_right_pad_id|>
        n = len(llama3)
        script.add_pad_token(llama3, script.stop_token_ids(llama3))
        assert llama3.pad_token == "<|finetune_right_pad_id|>" and len(llama3) == n
        qwen = make_tokenizer("pad_is_eos")  # pad == EOS: needs a new one, nothing unused to reuse
        padded = make_model("qwen2", 384)  # 341 tokens in 384 rows, as Qwen pads its vocabulary
        script.add_pad_token(qwen, script.stop_token_ids(qwen), padded)
        assert qwen.pad_token == "<|pad|>" and qwen.pad_token_id not in script.stop_token_ids(qwen)
        assert padded.get_input_embeddings().num_embeddings == 384
        llama2 = make_tokenizer("bos")
        exact = make_model("llama", len(llama2))
        script.add_pad_token(llama2, script.stop_token_ids(llama2), exact)
        assert exact.get_input_embeddings().num_embeddings == 384  # 341 → a multiple of 64, not 341


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # an output layer of its own; tied to the input embeddings
def test_new_embedding_rows_are_the_mean_and_the_same_in_the_policy_and_its_reference(arch):
    """A new pad id grows the embeddings. transformers draws the new rows at random, differently in a policy
    and its reference, so their log-softmax differs before any update; here both get the mean of the old rows."""
    for script in (sft, rlhf_ppo):
        tokenizer = make_tokenizer("bos")  # no pad, nothing unused: <|pad|> is added
        torch.manual_seed(0)
        policy = make_model(arch, len(tokenizer))
        reference = make_model(arch, len(tokenizer))
        reference.load_state_dict(policy.state_dict())
        old = policy.get_input_embeddings().weight.detach().clone()
        script.prepare_models(tokenizer, script.stop_token_ids(tokenizer), [policy, reference], [reference])
        for model in (policy, reference):
            for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
                assert embedding.weight.shape[0] == 384
                assert torch.equal(embedding.weight[len(old):], embedding.weight[: len(old)].mean(0).expand(384 - len(old), -1))
        assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), reference.state_dict().values()))


def test_a_pad_id_past_the_embeddings_grows_them():
    """A tokenizer given a pad token after its model was made (one row short): the pad is fine (no stop
    token), so the embeddings used to stay as they were, and the first batch with a pad stopped in an
    IndexError."""
    for script in (sft, grpo):
        tokenizer = make_tokenizer("bos")
        model = make_model("llama", len(tokenizer))
        tokenizer.add_special_tokens({"pad_token": "<|my_pad|>"})
        assert tokenizer.pad_token_id == model.get_input_embeddings().num_embeddings
        script.add_pad_token(tokenizer, script.stop_token_ids(tokenizer), model)
        assert model.get_input_embeddings().num_embeddings == 384
        model(torch.tensor([[tokenizer.pad_token_id]]))  # an IndexError before


# ------------------------------------------------------------------------------------------------
# The helpers several LM scripts share are one text, pasted verbatim: copies must not drift.
# ------------------------------------------------------------------------------------------------
