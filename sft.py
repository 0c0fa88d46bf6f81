"""Supervised fine-tuning (RLHF stage 1a): next-token cross-entropy on the completion only.

By default, offline: a tiny GPT-2 built from a config learns the built-in `sort <digits>:` task from
a sloppy demonstrator (half its answers have one adjacent swap), so every later stage can be measured
against an exact gold reward. The same program fine-tunes a real model on a real dataset:

    python sft.py                                                    # built-in task, ~100 s on 2 CPU cores
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset-name trl-lib/Capybara --lr 2e-5
    python sft.py --dataset-name data.jsonl --model-name-or-path models/sft

Datasets in TRL's formats: `prompt`/`completion` as text or conversations (loss on the completion and
its stop token), `text` (loss on every token) or `messages` (chat template; loss on the assistant
turns). Weights and AdamW state are float32; `--bf16` (on by default with CUDA) computes in bfloat16.

This is the one-device reference. scale/sft.py computes the same thing and adds what larger runs need:
torchrun (DDP, FSDP2), LoRA, gradient accumulation and checkpointing, checkpoints that resume exactly.
"""
import datetime
import itertools
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, part of the run name runs/<exp>__<seed>__<time> (run_name)"""
    seed: int = 1
    """seed of python, torch and the built-in task's data"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    threads: int | None = None
    """torch CPU threads (default: OMP_NUM_THREADS where set, else one fewer than the cores, at least 1: a thread
    that waits for a core stalls the others at every step, so leaving a core free keeps a run's speed on a busy
    machine; README's quickstart has the figures)"""
    progress: bool = True
    """on a terminal, a line every ~10 s: the steps done, their rate, the time left (--no-progress: none)"""
    model_name_or_path: str | None = None
    """hub id or local directory of a causal LM to fine-tune; None builds the tiny GPT-2 below from scratch"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or a .json/.jsonl/.parquet file; None uses the built-in sort task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/sft"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path (float32 from scratch)"""

    max_steps: int = 1500
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """sequences per optimizer step"""
    lr: float = 3e-3
    """peak learning rate of AdamW (a pretrained model wants ~1e-5 to 2e-5; TRL: learning_rate)"""
    warmup_steps: Annotated[int | None, tyro.conf.DisallowNone] = None
    """linear warmup steps (0: none), times a cosine decay to 0 over the whole run (default: 100, or a tenth of
    --max-steps where that is fewer)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """longest sequence in tokens: longer prompt/completion and messages examples are dropped (and counted); `text`
    examples are cut to it (default: 64 on the built-in task, TRL's 1024 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast), weights and AdamW
    state float32"""
    eval_every: int = 500
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """eval prompts / examples, 0 for no evaluation (the built-in task's eval set comes from its own random stream)"""
    max_new_tokens: Annotated[int | None, tyro.conf.DisallowNone] = None
    """tokens sampled per completion in evaluation (default: 12 on the built-in task; on a dataset, the longest
    completion of the 8 held-out examples it samples)"""
    num_train_examples: int = 100_000
    """size of the built-in task's training set"""

    n_layer: int = 3
    """tiny model (when no --model-name-or-path): transformer blocks"""
    n_embd: int = 128
    """tiny model: width"""
    n_head: int = 4
    """tiny model: attention heads"""


# ---------------------------------------------------------------------------------------------
# The math: the loss, a pure function checked against hand-computed values in tests/test_sft.py
# ---------------------------------------------------------------------------------------------
def sft_loss(logprobs, labels, num_items=None):
    """Cross-entropy of the next-token predictions on the labeled tokens (completion and its stop token;
    the prompt and the padding carry the label −100), from `logprobs`[:, t] = log p_θ(labels[:, t + 1] | x_≤t),
    the model's log-prob at position t of the token that follows:

        L = −(1/N) Σ_{t: y_t ≠ −100} log p_θ(y_t | x_<t)

    N is the number of labeled tokens in the whole batch: pass it as `num_items` when the batch is
    split into micro-batches, so that every token weighs the same whatever micro-batch it is in.
    """
    labeled = labels[:, 1:] != -100
    nll = -(logprobs[:, :-1] * labeled).sum()
    return nll / (num_items if num_items is not None else labeled.sum())


def check_args(args):
    """Every flag checked before any work: one line that says what to change."""
    settle_warmup(args, 100, "cosine")  # --warmup-steps, where not given
    settle_lengths(args, {"max_length": (64, 1024), "max_new_tokens": (12, None)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1, "eval_size": 0,
                        "max_new_tokens": 1, "num_train_examples": 1, "n_layer": 1, "n_embd": 1, "n_head": 1}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "weight_decay": ">= 0", "max_grad_norm": "> 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    random.seed(args.seed)  # the data order
    torch.manual_seed(args.seed)  # the model's initial weights and the sampling
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # The tokenizer, the data (tokenized and checked before the model is built), the model
    tokenizer = make_tokenizer(args.model_name_or_path)
    stop_ids = stop_token_ids(tokenizer)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_examples, eval_examples = load_data(args, demonstration_row, args.num_train_examples,
                                              [("prompt", "completion"), ("text",), ("messages",)],
                                              "accepts prompt+completion, text, or messages")
    train = tokenize_examples(tokenizer, train_examples, stop_ids, args.max_length, "train")
    evals = tokenize_examples(tokenizer, eval_examples, stop_ids, args.max_length, "eval")
    model = make_model(args, tokenizer)
    sampled = [prompt_length(labels) for _, labels in evals[:8]]  # the prompts of own data's samples
    longest = max([len(data_completion(labels, n)) for (_, labels), n in zip(evals, sampled)], default=1)
    settle_room(args, "max_new_tokens", longest, "the longest completion of the 8 held-out examples sampled",
                (model_positions(model) or math.inf) - max(sampled, default=0))
    prepare_models(tokenizer, stop_ids, [model])
    model = model.to(device)
    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training examples")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    model.train()
    order, position = list(range(len(train))), len(train)
    start_time, model_time, tokens_seen = time.time(), 0.0, 0
    progress = Progress(args.max_steps, "steps", args.progress)
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):  # a new pass over the data, reshuffled
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "cosine")
        optimizer.param_groups[0]["lr"] = lr

        # ---- update: log π_θ(y_t | x_<t) of every next token, the loss on the labeled ones ---------
        tick = time.time()
        input_ids, attention_mask, labels = (t.to(device) for t in collate(batch, tokenizer.pad_token_id))
        with amp():  # use_cache=False: a pass that does not sample keeps no KV cache (as TRL's trainers)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logprobs = gather_logprobs(logits, next_tokens(labels))
        loss = sft_loss(logprobs, labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        check_finite(step, loss=loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick
        tokens_seen += int(attention_mask.sum())

        # ---- log and evaluate -----------------------------------------------------------------------
        if step % 10 == 0:
            elapsed = time.time() - start_time
            writer.add_scalar("losses/loss", loss.item(), step)
            writer.add_scalar("train/grad_norm", float(grad_norm), step)
            writer.add_scalar("charts/learning_rate", lr, step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", tokens_seen / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        progress(step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(model, tokenizer, stop_ids, evals, eval_examples if args.dataset_name is None else [], args,
                     amp, writer, step)

    save_model(model, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir}")
    writer.close()


@torch.no_grad()
def evaluate(model, tokenizer, stop_ids, evals, task_examples, args, amp, writer, step):
    """The completion loss on held-out examples; on the built-in task (`task_examples`) also the gold reward of
    sampled and greedy completions, which a loss cannot show: an answer one swap from right still scores."""
    model.eval()
    logs = {}
    if evals:
        total, count = 0.0, 0
        for i in range(0, len(evals), args.batch_size):
            input_ids, attention_mask, labels = (t.to(model.device) for t in collate(evals[i : i + args.batch_size],
                                                                                     tokenizer.pad_token_id))
            with amp():
                logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            total += sft_loss(gather_logprobs(logits, next_tokens(labels)), labels, num_items=1).item()  # summed NLL
            count += (labels[:, 1:] != -100).sum().item()
        logs["eval/loss"] = total / count
    if task_examples:
        prompt_ids = [encode_prompt(tokenizer, ex["prompt"]) for ex in task_examples]
        for name, greedy in (("", False), ("_greedy", True)):
            completions = []
            for i in range(0, len(prompt_ids), args.batch_size):
                with amp():
                    sequences, _, width, _, _ = generate(model, prompt_ids[i : i + args.batch_size],
                                                         tokenizer.pad_token_id, stop_ids, args.max_new_tokens,
                                                         greedy=greedy)
                # the text up to the stop token: the stop token and the padding after it are special tokens
                completions += tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
            if not greedy:
                sampled = completions  # the samples shown in TensorBoard
            targets = [ex["target"] for ex in task_examples]
            logs[f"eval/gold_accuracy{name}"] = sum(c == t for c, t in zip(completions, targets)) / len(targets)
            logs[f"eval/gold_score{name}"] = sum(gold_score(c, t) for c, t in zip(completions, targets)) / len(targets)
        writer.add_text("eval/samples", "\n".join(f"    {ex['prompt']} {c!r} (target {ex['target']})"
                                                  for ex, c in zip(task_examples[:8], sampled)), step)
    elif evals:  # own data: completions sampled from 8 held-out prompts, beside the data's, to read with the loss
        prompts = [ids[: prompt_length(labels)] for ids, labels in evals[:8]]
        with amp():
            sequences, _, width, _, _ = generate(model, prompts, tokenizer.pad_token_id, stop_ids, args.max_new_tokens)
        completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
        samples = samples_text(tokenizer, prompts, completions, [labels for _, labels in evals[:8]])
        writer.add_text("eval/samples", samples, step)
    for tag, value in logs.items():
        writer.add_scalar(tag, value, step)
    if step == min(args.eval_every, args.max_steps):  # once: what the numbers are
        print(f"evaluation: eval/loss over {len(evals):,} held-out examples" + (f"; eval/gold_* of {len(task_examples):,} "
              "prompts, one completion each sampled at temperature 1 (_greedy: the argmax)" if task_examples else ""))
    print(f"step {step}: " + ", ".join(f"{tag} {value:.4f}" for tag, value in logs.items()))
    if step == args.max_steps and evals and not task_examples:  # the run's last lines: what it learned
        print(f"held-out prompts, the completion sampled from each and the data's:\n{samples}")
    model.train()


def samples_text(tokenizer, prompts, completions, labels):
    """eval/samples on own data, and the last lines a run on it prints: each held-out prompt (its last 300
    characters), the completion sampled from it, and the data's (data_completion), one per line."""
    data = tokenizer.batch_decode([data_completion(label, len(p)) for p, label in zip(prompts, labels)],
                                  skip_special_tokens=True)
    return "\n".join(f"    {tokenizer.decode(p)[-300:]!r} {c!r} (data: {d!r})"
                     for p, c, d in zip(prompts, completions, data))


def data_completion(labels, start):
    """The data's completion of the prompt of `start` tokens: its labeled tokens from there up to the first
    unlabeled one (of a conversation, the assistant turn that follows the prompt, not the turns after it)."""
    return list(itertools.takewhile(lambda t: t != -100, labels[start:]))


def prompt_length(labels):
    """The tokens of an example before its first labeled one (its prompt); a `text` example, labeled throughout:
    the first half of it."""
    start = next((t for t, label in enumerate(labels) if label != -100), len(labels))
    return start if start > 0 else max(1, len(labels) // 2)


# The built-in tiny model's chat template, over ByT5's bytes: `role: content</s>` a turn (EOS ends it), the tools'
# names on a first line, a tool call in Qwen2.5's format with compact JSON; agent_grpo.py's built-in task uses it
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{\"name\":\"{{ c['function']['name'] }}\",\"arguments\":"
    "{{ c['function']['arguments'] | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def make_tokenizer(path):
    """The tokenizer of the model at `path`; with no path, a byte-level one that needs no files (ByT5's: pad 0
    differs from EOS 1), for the tiny model of the built-in task, with a chat template of its own that renders tools
    (BYTE_CHAT_TEMPLATE)."""
    if path is None:
        from transformers import ByT5Tokenizer

        tokenizer = ByT5Tokenizer()
        tokenizer.chat_template = BYTE_CHAT_TEMPLATE
        return tokenizer
    return load_tokenizer(path, "pass an existing directory or a hub id")


def make_model(args, tokenizer):
    """The model to fine-tune: the checkpoint at --model-name-or-path (dropout as it has it), or else a tiny GPT-2
    of the built-in task from scratch, with no dropout."""
    if args.model_name_or_path is not None:
        return load_pretrained(args.model_name_or_path)
    from transformers import GPT2Config, GPT2LMHeadModel

    # 256 positions: room for longer prompts and responses in the later stages than --max-length here
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=max(256, args.max_length), n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config)


# =============================================================================================
# Plumbing: the built-in task, tokenization, data and model loading, sampling, saving. Each
# definition below is pasted from the scripts that share it, one text in all of them
# (tests/test_copies.py checks each), and this file holds only those its main reaches. A reader learning
# the algorithm can stop here.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# The built-in task: sort the digits. The gold reward is known exactly, so every stage is measured
# against it: SFT learns from a sloppy demonstrator, the reward model from noisy preference pairs.
# ---------------------------------------------------------------------------------------------
def levenshtein(a, b):
    """Edit distance: insertions, deletions and substitutions, each of cost 1."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def gold_score(completion, target):
    """1 − min(1, levenshtein(completion, target) / len(target)): 1 for the exact answer."""
    return 1.0 - min(1.0, levenshtein(completion, target) / len(target))


def make_prompt(rng):
    """`sort <n digits>:` with n uniform in [4, 8]; returns (prompt, target)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 8)))
    return f"sort {digits}:", "".join(sorted(digits))


def corrupt(rng, s, kinds=("swap", "drop", "insert", "replace")):
    """One random corruption of s; a swap exchanges two adjacent, unequal digits."""
    while True:
        kind, i = rng.choice(kinds), rng.randrange(len(s))
        if kind == "swap":
            pairs = [j for j in range(len(s) - 1) if s[j] != s[j + 1]]
            if pairs:
                j = rng.choice(pairs)
                return s[:j] + s[j + 1] + s[j] + s[j + 2 :]
            if kinds == ("swap",):
                return s  # all digits equal: nothing to swap
        elif kind == "drop":
            return s[:i] + s[i + 1 :]
        elif kind == "insert":
            return s[:i] + rng.choice("0123456789") + s[i:]
        elif kind == "replace":
            return s[:i] + rng.choice([d for d in "0123456789" if d != s[i]]) + s[i + 1 :]


def demonstration_row(rng):
    """A row of SFT's data: a prompt, its target, and the sloppy demonstrator's completion: the target, or with
    probability 0.5 the target with one adjacent swap."""
    prompt, target = make_prompt(rng)
    return {"prompt": prompt, "target": target,
            "completion": target if rng.random() < 0.5 else corrupt(rng, target, ("swap",))}


def task_rows(seed, split, n, task_row):
    """n rows of the built-in task in TRL's formats, each made by `task_row` (demonstration_row, preference_row
    or prompt_row) with its `target`. Train and eval rows come from different random streams of the same seed."""
    rng = random.Random(f"sort-task/{seed}/{split}")
    return [task_row(rng) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Tokenization as the model expects it, one text for every script, so that the reward model scores
# exactly the token sequences SFT trained on and PPO, DPO and GRPO produce. Data rows are in TRL's
# formats: text, or conversations (lists of {"role", "content"} messages) rendered by the chat template.
# ---------------------------------------------------------------------------------------------
def render_chat(tokenizer, messages, add_generation_prompt=False, tools=None):
    """Token ids of a conversation rendered by the tokenizer's chat template, with the JSON schemas of `tools`
    (a row's `tools` column, TRL's) where there are any."""
    if tokenizer.chat_template is None:
        sys.exit("error: the data is conversational (lists of role/content messages) but the tokenizer has no "
                 "chat template; use a chat model's tokenizer, or text data")
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def encode_prompt(tokenizer, prompt):
    """A prompt's token ids: a conversation through the chat template, ending with the assistant's header;
    a text with BOS first where the tokenizer prepends one (Llama, Mistral, Gemma), and never the EOS that
    T5-style tokenizers append as their special token."""
    if isinstance(prompt, list):
        return render_chat(tokenizer, prompt, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("")["input_ids"][:1] == [bos] and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


def stop_token_ids(tokenizer):
    """The tokens that end a completion: EOS, and the chat template's end-of-turn token when it is another
    one (ChatML's <|im_end|>, Llama 3's <|eot_id|>). One set for the SFT labels, sampling, the response
    mask, the reward model's scoring position and the missing-EOS penalty."""
    if tokenizer.eos_token_id is None:
        sys.exit("error: the tokenizer has no EOS token, so completions cannot end; set tokenizer.eos_token and save it")
    stops = [tokenizer.eos_token_id]
    if tokenizer.chat_template is not None:
        turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:
            full = render_chat(tokenizer, turn)
            header = render_chat(tokenizer, turn[:1], add_generation_prompt=True)
        except Exception:  # noqa: BLE001  a template that cannot render this probe: EOS alone
            return stops
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        end_of_turn = next((t for t in full[len(header) :] if t in special), None)
        if end_of_turn is not None and end_of_turn not in stops:
            stops.append(end_of_turn)
    return stops


def tokenize_pair(tokenizer, prompt, completion, stop_ids):
    """(prompt_ids, completion_ids), the completion ending with a stop token. A text completion is
    tokenized on its own, EOS appended. A conversational one (assistant messages after a conversational
    prompt) is what the chat template adds to the prompt's rendering, up to and including its first stop
    token: what a template writes after it (a newline) is never sampled, so it is not trained on either."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not isinstance(completion, list):
        return prompt_ids, tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    full = render_chat(tokenizer, prompt + completion)
    if full[: len(prompt_ids)] != prompt_ids:
        sys.exit("error: the chat template renders a conversation's start differently once a reply follows, so "
                 "prompt and completion tokens cannot be told apart; use text prompt/completion data")
    completion_ids = full[len(prompt_ids) :]
    ends = [i for i, t in enumerate(completion_ids) if t in stop_ids]
    return prompt_ids, completion_ids[: ends[0] + 1] if ends else completion_ids + [tokenizer.eos_token_id]


def add_pad_token(tokenizer, stop_ids, *models):
    """Make sure the tokenizer has a pad token that is no stop token, so that masking padding never masks
    an EOS the model must learn. Reuse an unused special token where the tokenizer has one (Llama 3's
    <|finetune_right_pad_id|>, reserved or unused tokens), else add <|pad|>. Grow the embeddings only where
    an id does not fit (to a multiple of 64), never shrink a vocabulary padded for speed, and give the new
    rows the mean of the old ones: the same in every model, so that a policy and its reference stay equal
    (transformers' default draws them at random, differently in each)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in stop_ids:
        taken = set(stop_ids) | {tokenizer.bos_token_id, tokenizer.unk_token_id}
        unused = [t.content for i, t in sorted(tokenizer.added_tokens_decoder.items())
                  if t.special and i not in taken and t.content not in (tokenizer.chat_template or "")]
        preferred = [c for c in unused if "pad" in c.lower()] + [c for c in unused if "reserved" in c or "unused" in c]
        tokenizer.add_special_tokens({"pad_token": preferred[0] if preferred else "<|pad|>"})
    needed = max(len(tokenizer), tokenizer.pad_token_id + 1)  # an added token's id can lie past len(tokenizer)
    for model in models:
        rows = model.get_input_embeddings().num_embeddings
        if needed > rows:
            model.resize_token_embeddings(needed, pad_to_multiple_of=64, mean_resizing=False)
            with torch.no_grad():
                for embedding in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
                    embedding.weight[rows:] = embedding.weight[:rows].mean(0)


def tokenize(example, tokenizer, stop_ids):
    """(input_ids, labels) of one example, labels −100 where no loss is taken:
    prompt/completion (text or conversational): the loss on the completion and its stop token;
    text: on every token, EOS appended; messages: on each assistant turn up to its stop token (tool calls and
    `tool` turns as TRL's, the tools' schemas from a `tools` column: the loss on the assistant's turns only)."""
    if example.get("messages") is not None:
        messages, ids, labels, stopped = example["messages"], [], [], True
        tools = json.loads(example["tools"]) if isinstance(example.get("tools"), str) else example.get("tools")
        for i, message in enumerate(messages):
            renders = [render_chat(tokenizer, messages[: i + 1], tools=tools)]
            if message["role"] == "assistant":  # the assistant header is prompt, not completion
                renders.insert(0, render_chat(tokenizer, messages[:i], add_generation_prompt=True, tools=tools))
            for full in renders:
                # Each render must extend the previous one. Templates that re-render earlier turns once later
                # ones exist (e.g. dropping past reasoning) break this, and the labels would be misplaced.
                if full[: len(ids)] != ids:
                    sys.exit("error: the chat template renders earlier turns differently once later turns exist (e.g. "
                             "it drops past reasoning), so assistant turns cannot be labeled; split each conversation "
                             "into prompt/completion rows, one per assistant turn")
                new, ids = full[len(ids) :], full
                if full is renders[-1] and message["role"] == "assistant":
                    ends = [j for j, t in enumerate(new) if t in stop_ids]
                    n, stopped = (ends[0] + 1, True) if ends else (len(new), False)
                    labels += new[:n] + [-100] * (len(new) - n)
                else:
                    labels += [-100] * len(new)
        if not stopped and messages[-1]["role"] == "assistant":  # a template with no end-of-turn token: EOS ends the reply
            ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
        return ids, labels
    if example.get("prompt") is not None and example.get("completion") is not None:
        prompt_ids, completion_ids = tokenize_pair(tokenizer, example["prompt"], example["completion"], stop_ids)
        return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids
    ids = encode_prompt(tokenizer, example["text"]) + [tokenizer.eos_token_id]
    return ids, list(ids)


def tokenize_examples(tokenizer, examples, stop_ids, max_length, split):
    """[(input_ids, labels)] of the examples that fit `max_length` (a `text` example is cut to it); the others
    are dropped and counted, as are examples with nothing to learn."""
    kept, dropped, lengths = [], 0, []
    for ex in examples:
        ids, labels = tokenize(ex, tokenizer, stop_ids)
        if ex.get("text") is not None and ex.get("messages") is None and ex.get("completion") is None:
            ids, labels = ids[:max_length], labels[:max_length]
        lengths.append(len(ids))
        if len(ids) > max_length or all(label == -100 for label in labels[1:]):
            dropped += 1
        else:
            kept.append((ids, labels))
    if dropped:
        print(f"{split}: dropped {dropped:,} of {len(examples):,} examples longer than --max-length {max_length} "
              f"or with nothing to learn (the longest: {max(lengths):,} tokens)")
    if not kept and split == "train":
        sys.exit(f"error: no training example fits --max-length {max_length}: they have {min(lengths):,} to "
                 f"{max(lengths):,} tokens; raise --max-length (TRL's default: 1024)")
    return kept


# ---------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------
def model_positions(model):
    """The longest sequence the model takes, or None when its config does not say."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)


def first_line(e):
    """An exception's message as one line, for a one-line error: its first line, or the exception's type when
    the message is empty."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def offline_unless_the_hub_answers(name):
    """Before hub id `name` is fetched: when the hub does not answer within 3 s, this process works offline, as
    HF_HUB_OFFLINE=1 makes it (what the local cache holds loads; what it lacks fails at once, not after half a
    minute of retries). Returns what the error line of a failed load adds: the way out, when offline."""
    import huggingface_hub.constants as hub

    proxy = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not hub.HF_HUB_OFFLINE and not proxy:  # behind a proxy the hub is not reached directly
        url = urllib.parse.urlparse(hub.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        except OSError:
            import datasets.config

            hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    return (f"; offline (the hub does not answer, or HF_HUB_OFFLINE=1) only the local cache is read, and it lacks "
            f"{name!r}: pass a local directory, or download it where there is a network" if hub.HF_HUB_OFFLINE else "")


def load_rows(name, config, split):
    """(the rows of `split`, the rows of a `test` split or None, place) of a dataset: a .jsonl or .json file
    (read here, so that an error names its line), a .parquet file, a `save_to_disk` directory or a hub id
    (with its config name, if it has several: gsm8k "main"). `place(i, split)` names row i in an error line."""
    import datasets

    datasets.disable_progress_bars()
    if name.endswith((".json", ".jsonl")) and os.path.isfile(name):
        data, lines = read_json_rows(name)
        place = lambda i, split: f"{name}, line {lines[i]}" if lines else f"{name}, row {i + 1}"  # noqa: E731
    else:
        offline = ""
        try:
            if name.endswith((".json", ".jsonl", ".parquet")):  # a missing file: "Unable to find ..."
                data = datasets.load_dataset("parquet" if name.endswith(".parquet") else "json", data_files=name)
            elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
                data = datasets.load_from_disk(name)
            else:
                offline = offline_unless_the_hub_answers(name)
                data = datasets.load_dataset(name, config)
        except Exception as e:  # noqa: BLE001  any loading failure becomes one line
            sys.exit(f"error: cannot load dataset {name!r}: {first_line(e).rstrip('.')}{offline}")
        place = lambda i, split: f"dataset {name!r}, split {split!r}, row {i + 1}"  # noqa: E731
    if split not in data:
        sys.exit(f"error: dataset {name!r} has the splits {list(data)}; pass one of them as --dataset-split")
    rows = list(data[split])
    if not rows:
        sys.exit(f"error: split {split!r} of dataset {name!r} has no rows")
    return rows, list(data["test"]) if "test" in data and split != "test" else None, place


def read_json_rows(path):
    """({"train": rows}, the .jsonl line of each row or None) of a .jsonl file, or of a .json file holding a list
    of rows or an object of columns; every row has every column, None where it has none (as datasets reads
    them). An empty file, or a line that is not JSON or not an object, is one line naming the file and line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    rows, lines, number = [], [], 0  # number: the .jsonl line read last
    try:
        if path.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    rows.append(json.loads(line))
                    lines.append(number)
                    if not isinstance(rows[-1], dict):
                        sys.exit(f"error: {path}, line {number}: a JSON {type(rows[-1]).__name__}, not an object")
        else:
            rows, lines = json.loads(text), None
            if isinstance(rows, dict) and all(isinstance(column, list) for column in rows.values()):
                rows = [dict(zip(rows, values)) for values in zip(*rows.values())]  # an object of columns
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                sys.exit(f"error: {path} holds neither a list of rows (JSON objects) nor an object of columns")
    except json.JSONDecodeError as e:
        sys.exit(f"error: {path}, line {number or e.lineno}: not JSON ({e.msg}, column {e.colno})")
    if not rows:
        sys.exit(f"error: {path} has no rows")
    columns = dict.fromkeys(column for row in rows for column in row)
    return {"train": [{column: row.get(column) for column in columns} for row in rows]}, lines


def row_problem(row, columns):
    """What is wrong with a row's `columns`, in words, or None: a field missing or null, empty, or neither text
    nor a conversation (a list of {"role", "content"} messages with a known role), or text in one field and a
    conversation in another. `text` must be text, `messages` a conversation and `label` true or false (KTO's)."""
    kinds, roles = {}, ("system", "developer", "user", "assistant", "tool")
    for column in columns:
        value = row.get(column)
        if value is None:
            return f"no `{column}` (missing or null)"
        if column == "label" and isinstance(value, bool):  # KTO's unpaired format: a thumbs up or down
            continue
        if isinstance(value, str) and column not in ("messages", "label"):
            kinds[column] = "text"
        elif isinstance(value, list) and column not in ("text", "label"):
            for j, message in enumerate(value, 1):
                if not isinstance(message, dict):
                    return f"`{column}`, message {j} is a {type(message).__name__}, not a {{role, content}} object"
                if message.get("role") not in roles:
                    return f"`{column}`, message {j}: {message.get('role')!r} is not a role ({', '.join(roles)})"
                if not isinstance(message.get("content"), str) and "tool_calls" not in message:
                    return f"`{column}`, message {j}: its `content` is not text"
            kinds[column] = "a conversation"
        else:
            kind = {"text": "text", "messages": "a list of messages", "label": "true or false"}.get(
                column, "text or a list of messages")
            name = {"int": "a number", "float": "a number", "dict": "an object", "str": "text"}.get(type(value).__name__)
            return f"`{column}` is {name or 'a ' + type(value).__name__}" + f" ({value})" * (name == "a number") + \
                f", not {kind}"
        if not value:
            return f"`{column}` is empty"
    if len(set(kinds.values())) > 1:
        return " but ".join(f"`{column}` is {kind}" for column, kind in kinds.items()) + "; a row is all one kind"
    return None


def load_data(args, task_row, num_train, accepts, needs):
    """(train rows, eval rows): the built-in task's rows (`task_row` makes one) when no --dataset-name is given,
    else the dataset's, each checked (row_problem) in the first set of columns in `accepts` the dataset has all
    of (`needs` says so in words). The eval rows are its `test` split, or else --eval-size rows of the split (a
    tenth at most) drawn at random with --seed and held out: a sorted file's first rows are not like the rest."""
    if args.dataset_name is None:
        return task_rows(args.seed, "train", num_train, task_row), task_rows(args.seed, "eval", args.eval_size, task_row)
    rows, test, place = load_rows(args.dataset_name, args.dataset_config, args.dataset_split)
    columns = next((accepted for accepted in accepts if set(rows[0]) >= set(accepted)), None)
    if columns is None:
        sys.exit(f"error: dataset {args.dataset_name!r} has columns {sorted(rows[0])}; {os.path.basename(__file__)} "
                 f"{needs}")
    for split, part in ((args.dataset_split, rows), ("test", (test or [])[: args.eval_size])):
        for i, row in enumerate(part):
            if problem := row_problem(row, columns):
                sys.exit(f"error: {place(i, split)}: {problem} ({os.path.basename(__file__)} {needs})")
    if test is not None:
        return rows, test[: args.eval_size]
    held_out = random.Random(args.seed).sample(range(len(rows)), min(args.eval_size, len(rows) // 10))
    return [rows[i] for i in sorted(set(range(len(rows))) - set(held_out))], [rows[i] for i in held_out]


def load_tokenizer(path, hint):
    """The tokenizer of a hub id or local directory. A local path that does not exist, or a checkpoint that
    cannot be read, is one line (`hint` says what to do about a missing directory)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        sys.exit(f"error: model directory {path!r} does not exist; {hint}")
    offline = "" if os.path.isdir(path) else offline_unless_the_hub_answers(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a tokenizer from {path!r}: {first_line(e).rstrip('.')}{offline}")


def load_pretrained(path):
    """A checkpoint as a causal LM, dropout as it has it, its weights in float32 whatever they were saved in:
    AdamW needs float32 master weights (in fp16 its eps underflows to 0, in bf16 most small updates round
    away); --bf16 is the mixed-precision choice on top."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a model from {path!r}: {first_line(e)}")


def prepare_models(tokenizer, stop_ids, models, frozen=()):
    """Give the tokenizer a pad token (growing the models' embeddings if it needs a new id) and tell every
    model its id; the `frozen` ones among them go to eval mode without gradients. The models stay where they are
    (the CPU): the caller puts them on the device."""
    add_pad_token(tokenizer, stop_ids, *models)
    for model in models:
        model.config.pad_token_id = tokenizer.pad_token_id
    for model in frozen:
        model.eval().requires_grad_(False)


def save_dtype_of(args, path):
    """The dtype a trained model is saved in: --save-dtype, or else that of the checkpoint at `path` (float32
    for a model built from scratch), so that a bf16 checkpoint comes back in bf16, not twice its size."""
    from transformers import AutoConfig

    if args.save_dtype is not None:
        if args.save_dtype not in ("float32", "bfloat16", "float16"):
            sys.exit(f"error: --save-dtype {args.save_dtype!r}: choose float32, bfloat16 or float16")
        return getattr(torch, args.save_dtype)
    dtype = AutoConfig.from_pretrained(path).dtype if path is not None else None
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


# ---------------------------------------------------------------------------------------------
# Forward passes and sampling
# ---------------------------------------------------------------------------------------------
def next_tokens(labels):
    """The token each position predicts, labels[:, t + 1], one per position (0 where unlabeled, and at the last
    position, which predicts nothing): sft_loss masks those."""
    return F.pad(labels[:, 1:], (0, 1), value=-100).clamp(min=0)


def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels): (input_ids, attention_mask, labels) tensors, labels −100 on padding."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
    return input_ids, attention_mask, labels


def gather_logprobs(logits, tokens):
    """log π(tokens[:, t] | x_≤t) = log_softmax(logits)[:, t, tokens[:, t]], in float32."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def position_ids_of(attention_mask):
    """Positions count real tokens only, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# The KV cache's name as a model's forward takes and returns it: transformers 5.24 renamed past_key_values to cache
# (the old keyword still works there, with a FutureWarning on every call)
CACHE = "cache" if tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


@torch.no_grad()
def generate(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature=1.0, greedy=False):
    """Complete each prompt (lists of token ids, left-padded here) with tokens drawn from softmax(logits / T) in
    float32, as transformers' generate draws them (the argmax if greedy), each response ending at its first stop token.
    Returns (sequences, attention_mask, context_length, response_mask), the responses as long as the longest
    one, response_mask 1 on response tokens up to and including the stop token. No sampling setting comes from
    the checkpoint's generation_config.json (top_k, repetition_penalty, ...): the distribution sampled is the one
    whose log-probs are trained. Two savings change nothing sampled: each distinct prompt's forward pass runs
    once, its KV cache copied to the rows that repeat it (GRPO's G completions), and a row that has stopped
    leaves the batch. Also returns sampler_logprobs: each drawn token's log-probability under the distribution
    it was drawn from (0 on padding), which the sampler holds anyway; RL compares it with the policy it trains."""
    device, width = model.device, max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    stops = torch.tensor(stop_ids, device=device)
    distinct, row_prompt = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
    prompt_mask = distinct[:, width:]
    out = model(input_ids=distinct[:, :width], attention_mask=prompt_mask, position_ids=position_ids_of(prompt_mask),
                use_cache=True, logits_to_keep=1)
    cache, logits = out[CACHE], out.logits[row_prompt, -1]
    cache.batch_select_indices(row_prompt)  # each row's copy of its prompt's keys and values
    responses = torch.full((len(input_ids), max_new_tokens), pad_token_id, device=device)
    sampler_logprobs = torch.zeros(len(input_ids), max_new_tokens, device=device)
    running, mask = torch.arange(len(input_ids), device=device), attention_mask  # the rows still sampling
    positions = attention_mask.sum(1)  # of each row's next token: positions count real tokens only
    for t in range(max_new_tokens):
        z = logits.float() / temperature
        tokens = z.argmax(-1) if greedy else torch.multinomial(torch.softmax(z, -1), 1).squeeze(1)
        responses[running, t] = tokens
        sampler_logprobs[running, t] = torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1)
        going = ~torch.isin(tokens, stops)
        if not going.all():  # the rows that stopped leave the batch, and their cache with them
            keep = going.nonzero().squeeze(1)
            running, tokens, positions, mask = running[keep], tokens[keep], positions[keep], mask[keep]
            cache.batch_select_indices(keep)
        if t + 1 == max_new_tokens or not len(running):
            break
        mask = F.pad(mask, (0, 1), value=1)
        logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=(positions + t)[:, None],
                       use_cache=True, **{CACHE: cache}).logits[:, -1]
    is_stop = torch.isin(responses, stops)
    # 1 up to and including the first stop token: a token is valid while no stop token came strictly before it
    response_mask = ((is_stop.cumsum(1) - is_stop.long()) == 0).long()
    length = int(response_mask.sum(1).max())  # the longest response: no later column is anything but padding
    response_mask = response_mask[:, :length]
    responses = responses[:, :length].masked_fill(response_mask == 0, pad_token_id)
    return (torch.cat([input_ids, responses], 1), torch.cat([attention_mask, response_mask], 1), width, response_mask,
            sampler_logprobs[:, :length] * response_mask)


# ---------------------------------------------------------------------------------------------
# Training and saving
# ---------------------------------------------------------------------------------------------
def settle_lengths(args, lengths):
    """The length flags not given (None), before the argument checks: {flag: (on the built-in task, on a
    dataset)}; a dataset's is TRL's default, or None where settle_room later measures it on the data and the model."""
    for name, (task, data) in lengths.items():
        if getattr(args, name) is None:
            setattr(args, name, task if args.dataset_name is None else data)


def settle_room(args, name, value, why, room):
    """A length flag left to the data (None): `value` (what the data needs, or TRL's default: `why` says which), cut
    to `room` (what the model's positions leave after the longest prompt) where it would not fit; printed once."""
    if getattr(args, name) is None:
        setattr(args, name, max(1, min(value, room)))
        if os.environ.get("RANK", "0") == "0":
            print(f"--{name.replace('_', '-')} {getattr(args, name)}: {why}"
                  + ("" if value <= room else f", cut to the {room} positions the model leaves after the longest prompt"))


def run_name(args):
    """runs/<exp>__<seed>__<time>, with the last part of --output-dir after <exp> where it is given and not <exp>: the
    runs of one script that train different models tell apart in TensorBoard (runs/sft__reverse-sft__1__<time>)."""
    output = os.path.basename(os.path.normpath(args.output_dir))
    given = f"__{output}" if args.output_dir != Args.output_dir and output != args.exp_name else ""
    return f"runs/{args.exp_name}{given}__{args.seed}__{int(time.time())}"


def settle_defaults(args):
    """The defaults that depend on the machine, settled before the argument checks (and logged as settled): --bf16
    on where CUDA has bfloat16, as in TRL's configs; on the CPU float32 is faster."""
    if args.bf16 is None:
        args.bf16 = args.cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def get_lr(step, lr, warmup_steps, max_steps, decay):
    """Learning rate of optimizer step `step` = 0, 1, ...: `lr` × a linear warmup min(1, (step + 1) / warmup_steps)
    × a decay to 0 at `max_steps`: "linear", min(1, (max_steps − step) / (max_steps − warmup_steps)), flat through
    the warmup; or "cosine", ½(1 + cos(π · step / max_steps)), over the whole run."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay == "linear":
        return lr * warmup * min(1.0, max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps)))
    return lr * warmup * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max_steps)))


def settle_warmup(args, default, decay):
    """--warmup-steps where not given: `default`, or a tenth of --max-steps where that is fewer. Given, it must end
    before the run does: a run that never leaves its warmup never trains at --lr (one line, before any work)."""
    if args.warmup_steps is None:
        args.warmup_steps = max(0, min(default, args.max_steps // 10))
    elif args.warmup_steps >= args.max_steps >= 1:
        peak = max(get_lr(step, 1.0, args.warmup_steps, args.max_steps, decay) for step in range(args.max_steps))
        sys.exit(f"error: --warmup-steps {args.warmup_steps} ≥ --max-steps {args.max_steps}: the run would end in its "
                 f"warmup, the learning rate at most {peak:.0%} of --lr; lower --warmup-steps or raise --max-steps")


class Progress:
    """A line every ~10 s on a terminal: the steps done of `total`, their rate, the time left at that rate, and a
    note (the RL scripts: their recent return). Silent where stdout is not a terminal (a log file, CI) or with
    --no-progress, so that a log holds the run's own lines only. `done`: the steps a resumed run starts from."""

    def __init__(self, total, unit, on, done=0, every=10.0):
        self.total, self.unit, self.first, self.every = total, unit, done, every
        self.on, self.start = on and sys.stdout.isatty(), time.time()
        self.last = self.start

    def __call__(self, done, note=""):
        now = time.time()
        if self.on and now - self.last >= self.every and done > self.first:
            rate = (done - self.first) / (now - self.start)
            left = datetime.timedelta(seconds=round((self.total - done) / rate))
            speed = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
            print(f"{done:,}/{self.total:,} {self.unit} ({done / self.total:.0%}), {speed} {self.unit}/s, {left} left"
                  + f", {note}" * bool(note))
            self.last = now


def check_finite(step, **values):
    """Stop the run with one line, before anything is saved, when a loss or gradient norm is NaN or inf."""
    for name, tensor in values.items():
        value = float(torch.as_tensor(tensor).detach())
        if not math.isfinite(value):
            sys.exit(f"error: {name} is {value} at step {step}; stopped, nothing saved "
                     "(lower --lr; with a half-precision model, train without --bf16 to check)")


def save_model(model, tokenizer, args, output_dir, dtype):
    """Save a Hugging Face model, its weights in `dtype` (save_dtype_of), with its tokenizer and the flags
    (training_args.json): written to a temporary directory, then renamed, so that a crash never leaves a
    half-written checkpoint."""
    tmp_dir = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
    try:
        model.to(dtype).save_pretrained(tmp_dir)  # config.json says the dtype; a tied weight is saved once
        tokenizer.save_pretrained(tmp_dir)
        with open(os.path.join(tmp_dir, "training_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        shutil.rmtree(output_dir, ignore_errors=True)
        os.replace(tmp_dir, output_dir)
    except OSError as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        sys.exit(f"error: cannot write the checkpoint to {output_dir!r}: {e}; nothing was saved")


def note_overwrite(output_dir):
    """One line before any work when --output-dir already holds a model: this run replaces it when it ends, and
    a later stage reads that directory, so the run says so rather than replace another run's model silently."""
    if os.environ.get("RANK", "0") != "0" or not any(os.path.exists(os.path.join(output_dir, name))
                                                      for name in ("config.json", "adapter_config.json")):
        return
    saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(output_dir)))
    try:
        with open(os.path.join(output_dir, "training_args.json")) as f:
            flags = json.load(f)
        length = next((f" --{k.replace('_', '-')} {flags[k]}" for k in ("max_steps", "num_iterations") if k in flags),
                      "")
        by = f" by a run of {flags.get('exp_name', '?')}{length}"
    except (OSError, ValueError):
        by = ""
    print(f"note: --output-dir {output_dir} holds a model saved {saved}{by}; this run replaces it when it ends")


def cpu_threads(threads):
    """--threads, or by default OMP_NUM_THREADS where it is set (torchrun sets 1 per rank), else one fewer than the
    cores this process may run on, at least 1."""
    if threads:
        return threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
