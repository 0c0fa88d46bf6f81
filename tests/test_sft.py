"""sft.py: the math against hand-computed values, then the script end to end."""
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
    only_run_dir,
    read_scalars,
    run_in_process,
    run_script,
    same_seed_scalars,
    split_rows,
)
from lm_models import make_tokenizer, save_checkpoint

import sft
from scale import sft as scale_sft


def test_sft_loss_masks_prompt_and_padding():
    # Sequences of 3; the log-prob at position t is that of label t+1 (head_logprobs' output).
    #   example 1: labels [−100 (prompt), 1, 0 (EOS)]:
    #     position 0: log p(1) = log 3/4 → nll 0.287682
    #     position 1: log p(0) = log 1/2 → nll 0.693147
    #   example 2: labels [−100, 1, −100 (padding)]:
    #     position 0: log p(1) = log 1/4 → nll 1.386294
    #     position 1 would predict padding: no loss, whatever its log-prob (−99); position 2 predicts nothing (−5)
    #   mean over the 3 labeled tokens: 2.367123 / 3 = 0.789041
    logprobs = torch.tensor([[math.log(0.75), math.log(0.5), -5.0], [math.log(0.25), -99.0, -5.0]])
    labels = torch.tensor([[-100, 1, 0], [-100, 1, -100]])
    assert sft.sft_loss(logprobs, labels).item() == pytest.approx(0.789041, abs=1e-6)
    # split into two micro-batches with num_items = 3, the halves add up to the same loss
    halves = sft.sft_loss(logprobs[:1], labels[:1], 3) + sft.sft_loss(logprobs[1:], labels[1:], 3)
    assert halves.item() == pytest.approx(0.789041, abs=1e-6)
    # the tokens head_logprobs is asked for: each position's next label, 0 where unlabeled or past the end
    assert sft.next_tokens(labels).tolist() == [[1, 0, 0], [1, 0, 0]]


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


def test_a_long_text_is_cut_to_max_length_and_a_long_completion_dropped():
    """TRL's `text` format has no completion to keep whole: a text longer than --max-length is cut to it and trained
    on (its first max_length tokens, labels as they were). A prompt/completion example that long is dropped, since
    cutting it would train on a completion with no end; and so is an example with nothing to learn."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    stop_ids = sft.stop_token_ids(tokenizer)
    examples = [{"text": "sort 4321: 1234"}, {"prompt": "sort 4321:", "completion": " 1234"},
                {"prompt": "sort 21:", "completion": " 12"}, {"text": ""}]
    kept = sft.tokenize_examples(tokenizer, examples, stop_ids, 12, "train")
    text_ids, text_labels = sft.tokenize(examples[0], tokenizer, stop_ids)
    assert kept == [(text_ids[:12], text_labels[:12]), sft.tokenize(examples[2], tokenizer, stop_ids)]


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
    for tag in ["losses/loss", "eval/loss", "eval/gold_accuracy", "eval/gold_score", "eval/gold_accuracy_greedy",
                "charts/samples_per_second", "charts/tokens_per_second"]:
        assert tag in sft_tags, tag
    rm_tags = read_scalars(str(runs["reward_model"]))
    for tag in ["losses/loss", "train/accuracy", "train/reward_chosen", "train/reward_rejected", "train/margin",
                "eval/loss", "eval/accuracy", "eval/gold_correlation"]:
        assert tag in rm_tags, tag
    assert not [p for p in os.listdir(tiny_checkpoints["cwd"] / "models") if ".tmp" in p]  # renamed when complete


def test_sft_on_a_local_jsonl_file_from_a_saved_model(tiny_checkpoints, tmp_path):
    rows = [{"prompt": f"add {i} {i}:", "completion": str(2 * i)} for i in range(60)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_script("sft.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "data.jsonl",
               "--max-steps", "4", "--batch-size", "8", "--eval-every", "2",
               "--output-dir", "out", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert "eval/loss" in scalars and "eval/gold_accuracy" not in scalars  # no gold reward for real data
    assert os.path.exists(tmp_path / "out" / "config.json")


def test_bad_input_one_line_errors(tmp_path):
    # through the real entry point, once: one line on stderr, no traceback
    assert_one_line_error(run_script("sft.py", "--model-name-or-path", "./no/such/model", cwd=tmp_path, check=False),
                          "./no/such/model")
    # a dataset with columns sft.py cannot use: names the columns found and the formats accepted
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    message = one_line_exit("sft.py", *TINY_LM, "--dataset-name", "bad.jsonl", cwd=tmp_path)
    assert all(word in message for word in ("question", "answer", "prompt+completion")), message
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "models")


def test_same_seed_same_logs_and_weights(tmp_path):
    flags = [*TINY_LM, "--max-steps", "6", "--eval-every", "3", "--num-train-examples", "200", "--eval-size", "16",
             "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("sft.py", flags, tmp_path)
    assert [tag for tag in logs_a if logs_a[tag] != logs_b.get(tag)] == [] and len(logs_a) >= 5
    assert saved_a == saved_b and len(saved_a) == 1


def test_the_tiny_model_has_the_size_the_flags_ask(tmp_path):
    """With no --model-name-or-path, --n-layer, --n-embd and --n-head shape the GPT-2 built from scratch: the saved
    config, and its weights counted against GPT-2's by hand: a block of width d holds 12d² + 13d (the attention's
    4d² + 4d, the MLP's 8d² + 5d, two layer norms' 4d), the embeddings (vocabulary + 256 positions) · d and the
    final norm 2d, the head tied to the token embeddings. A script that builds its defaults (3 layers, width 128,
    4 heads) fails."""
    run_in_process("sft.py", *CPU_FLOAT32, "--n-layer", "2", "--n-embd", "48", "--n-head", "3", "--max-steps", "1",
                   "--batch-size", "8", "--num-train-examples", "16", "--eval-size", "4", "--output-dir", "m", cwd=tmp_path)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (2, 48, 3)
    from transformers import AutoModelForCausalLM

    model, d = AutoModelForCausalLM.from_pretrained(tmp_path / "m"), 48
    assert sum(p.numel() for p in model.parameters()) == (config["vocab_size"] + 256) * d + 2 * d + 2 * (12 * d * d + 13 * d)


def sort_rows(n, seed):
    """n rows of a sort task made here, independent of the scripts' task code."""
    import random

    rng = random.Random(seed)
    digits = ["".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6))) for _ in range(n)]
    return [{"prompt": f"sort {d}:", "completion": "".join(sorted(d))} for d in digits]


def completion_nll(path, rows):
    """Σ −log p(completion and its EOS | prompt) over the rows, by the saved model, each row alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    total = 0.0
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1)
        total -= sum(logp[len(prompt) + t - 1, token].item() for t, token in enumerate(completion))
    return total


def test_one_step_lowers_the_completion_nll_of_its_batch(tiny_checkpoints, tmp_path):
    """The direction of the update: one AdamW step, at a small learning rate, on a batch that is the whole
    dataset lowers that batch's completion NLL (a loss of the wrong sign raises it)."""
    rows = sort_rows(8, seed=3)
    (tmp_path / "batch.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("sft.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "batch.jsonl",
                   "--max-steps", "1", "--batch-size", "8", "--lr", "1e-4", "--warmup-steps", "0",
                   "--output-dir", "out", cwd=tmp_path)
    before, after = completion_nll(tiny_checkpoints["sft"], rows), completion_nll(tmp_path / "out", rows)
    assert after < before - 1e-3, (before, after)


def test_an_exception_with_an_empty_message_still_makes_one_line(tmp_path):
    """An error that quotes an exception quotes its first line, or its type when the message is empty (datasets
    raises a bare StopIteration on an empty .jsonl file, which read_json_rows reads and names itself)."""
    assert sft.first_line(StopIteration()) == "StopIteration" and sft.first_line(ValueError("a\nb")) == "a"
    (tmp_path / "empty.jsonl").write_text("")
    assert one_line_exit("sft.py", *TINY_LM, "--dataset-name", "empty.jsonl", cwd=tmp_path) == \
        "error: empty.jsonl has no rows"
    # a data file that is not there: the path, in datasets' words
    message = one_line_exit("sft.py", *TINY_LM, "--dataset-name", "missing.jsonl", cwd=tmp_path)
    assert "missing.jsonl" in message and "Unable to find" in message, message


def test_it_learns_the_built_in_task_in_100_steps(tmp_path):
    """From scratch, 100 steps of 32 (the default warmup: a tenth of them): the held-out completion loss falls from
    5.6 (uniform over the bytes) to 1.83 (seed 1), below 2.5 and below its value at step 50 (2.00); with the loss's
    sign flipped it climbs."""
    run_in_process("sft.py", *TINY_LM, "--max-steps", "100", "--batch-size", "32", "--eval-every", "50",
                   "--eval-size", "32", "--num-train-examples", "2000", "--output-dir", "out", cwd=tmp_path)
    losses = [v for _, v in read_scalars(only_run_dir(tmp_path))["eval/loss"]]
    assert losses[-1] < 2.5 and losses[-1] < losses[0] - 0.1, losses


def test_the_logged_loss_is_the_completion_nll_of_the_starting_model(tiny_checkpoints, tmp_path):
    """What main hands the loss: at --lr 0 the model never moves, and with the whole dataset as the batch the loss
    logged at step 10 is the mean NLL of the completion tokens and their EOS under the starting model, computed here
    row by row. A loss also taken on the prompt tokens (or on the padding, or one position off) logs another number."""
    rows = sort_rows(8, seed=5)
    (tmp_path / "batch.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("sft.py", *CPU_FLOAT32, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "batch.jsonl",
                   "--max-steps", "10", "--batch-size", "8", "--lr", "0", "--warmup-steps", "0", "--eval-every", "10",
                   "--output-dir", "out", cwd=tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["sft"])
    tokens = sum(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    logged = read_scalars(only_run_dir(tmp_path))["losses/loss"]
    assert logged[0][0] == 10 and logged[0][1] == pytest.approx(completion_nll(tiny_checkpoints["sft"], rows) / tokens,
                                                                rel=1e-5), logged


def test_the_batch_size_and_max_length_reach_every_update(tiny_checkpoints, tmp_path, monkeypatch):
    """--batch-size and --max-length shape each update: 3 examples a step, none longer than 16 tokens, on data where
    most examples are longer (and dropped). A loop that reads either flag at its default (64) fails."""
    seen, real = [], sft.collate

    def spy(batch, pad_token_id):
        if torch.is_grad_enabled():  # the updates' batches: evaluate runs under no_grad
            seen.append([len(ids) for ids, _ in batch])
        return real(batch, pad_token_id)

    monkeypatch.setattr(sft, "collate", spy)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["sft"])
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in sort_rows(60, seed=7)))
    train = split_rows(tmp_path / "rows.jsonl")[0]  # 6 held out for evaluation
    length = lambda r: sum(len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) for k in r) + 1  # noqa: E731
    assert sum(length(r) > 16 for r in train) > 25 and sum(length(r) <= 16 for r in train) >= 6
    run_in_process("sft.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", "rows.jsonl",
                   "--max-steps", "4", "--batch-size", "3", "--max-length", "16", "--eval-every", "100",
                   "--output-dir", "out", cwd=tmp_path)
    assert len(seen) == 4 and all(len(batch) == 3 for batch in seen), seen
    assert max(max(batch) for batch in seen) <= 16, seen


# ------------------------------------------------------------------------------------------------
# Tool use in TRL's conversational format: the loss on the assistant's turns (its calls too), never on a tool's result
# ------------------------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def tool_row(a, b):
    """A conversation with one call of `multiply` and its result, as TRL's datasets hold it."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {"messages": [{"role": "user", "content": f"{a} times {b}?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "multiply", "content": str(a * b)},
                         {"role": "assistant", "content": f"It is {a * b}."}]}


@pytest.mark.parametrize("module", [sft, scale_sft], ids=["sft", "scale.sft"])
def test_tool_calls_are_trained_on_and_tool_results_are_not(module):
    """tokenize on a conversation with a tool call (Qwen2.5's format, a template of its own in lm_models.py): the
    labels are the assistant's call and its answer, each up to its end of turn; the tools' schemas (made from the
    function's type hints and docstring, as TRL's `tools=`) are rendered before the conversation from a `tools`
    column, a list or its JSON text, and the tool's result is prompt, never labeled."""
    from transformers.utils import get_json_schema

    tokenizer = make_tokenizer("tools")
    stop_ids = module.stop_token_ids(tokenizer)
    row = {**tool_row(3, 4), "tools": [get_json_schema(multiply)]}
    ids, labels = module.tokenize(row, tokenizer, stop_ids)
    assert tokenizer.decode([t for t in labels if t != -100]) == (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>It is 12.<|im_end|>')
    system, conversation = tokenizer.decode(ids).split("<|im_start|>user\n3 times 4?")
    assert '"name": "multiply"' in system and '"description": "the first factor"' in system
    assert "<tool_response>\n12\n</tool_response>" in conversation
    assert module.tokenize({**row, "tools": json.dumps(row["tools"])}, tokenizer, stop_ids) == (ids, labels)
    without = module.tokenize(tool_row(3, 4), tokenizer, stop_ids)
    assert "multiply" not in tokenizer.decode(without[0]).split("<|im_start|>user")[0]


def test_sft_trains_on_tool_use_conversations(tmp_path):
    """sft.py on a .jsonl of tool-use conversations with a `tools` column, a tiny random Qwen2 with that template:
    every row passes the row checks, the loss falls and the model is saved."""
    from transformers.utils import get_json_schema

    base = save_checkpoint(str(tmp_path / "base"), "qwen2", "tools", "float32", max_position_embeddings=1024)
    schema = get_json_schema(multiply)
    rows = [{**tool_row(a, b), "tools": [schema]} for a in range(2, 9) for b in range(2, 9)]
    (tmp_path / "tools.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    run_in_process("sft.py", "--model-name-or-path", base, "--dataset-name", "tools.jsonl", "--max-steps", "20",
                   "--batch-size", "8", "--warmup-steps", "0", "--lr", "3e-3", "--eval-every", "20", "--max-length",
                   "1024", "--output-dir", "out", cwd=tmp_path)
    losses = [v for _, v in read_scalars(only_run_dir(tmp_path))["losses/loss"]]
    assert losses[-1] < losses[0] and (tmp_path / "out" / "config.json").exists(), losses
