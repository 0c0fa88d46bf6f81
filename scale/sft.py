"""Supervised fine-tuning (RLHF stage 1a): next-token cross-entropy on the completion only.

By default, offline: a tiny GPT-2 built from a config learns the built-in `sort <digits>:` task from
a sloppy demonstrator (half its answers have one adjacent swap), so every later stage can be measured
against an exact gold reward. The same program fine-tunes a real model on a real dataset:

    python scale/sft.py                                                    # built-in task, ~100 s on 2 CPU cores
    python scale/sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset-name trl-lib/Capybara --lr 2e-5 --bf16
    python scale/sft.py --dataset-name data.jsonl --model-name-or-path models/sft

Datasets in TRL's formats: `prompt`/`completion` as text or conversations (loss on the completion and
its stop token), `text` (loss on every token) or `messages` (chat template; loss on the assistant
turns). A checkpoint saved in bf16 or fp16 is trained in float32 (master weights); `--bf16` adds mixed
precision.

The full program. Take it instead of the top-level sft.py, the one-device reference, for torchrun (DDP, FSDP2),
LoRA, gradient accumulation and checkpointing, or checkpoints that resume exactly; on one process it computes what
sft.py computes (tests/test_tiers.py).
"""
import datetime
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import sys
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
import tyro
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
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
    system_prompt: str | None = None
    """a system message put first in every conversation of the data that has none (conversational data only)"""
    output_dir: str = "models/sft"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path (float32 from scratch)"""

    max_steps: int = 1500
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """sequences per optimizer step, over all ranks: each of N ranks (torchrun) takes batch_size / N of them"""
    gradient_accumulation_steps: int = 1
    """split each rank's share of a batch into this many micro-batches (the same update, less memory)"""
    gradient_checkpointing: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on under --fsdp, else off) recompute activations in the backward pass (less memory, one more forward
    pass of compute)"""
    compile: bool = False
    """torch.compile each transformer block of the trained model for the passes that compute gradients (fewer,
    fused kernels; the first steps pay the compile time; docs/scaling.md measures it)"""
    eval_batch_size: int | None = None
    """prompts per sampling call in evaluation, on each rank (None: training's micro-batch size; the eval loss runs
    in micro-batches of training's size: a forward pass that fits with gradients fits without)"""
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
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast; FSDP2's
    MixedPrecisionPolicy under --fsdp), weights and AdamW state float32"""
    fsdp: bool = False
    """under torchrun, shard the model, its gradients and AdamW state across the ranks (FSDP2) instead of a full
    copy on each (DDP): for models whose training state does not fit one device"""
    eval_every: int = 500
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """eval prompts / examples, 0 for no evaluation (the built-in task's eval set comes from its own random stream)"""
    max_new_tokens: Annotated[int | None, tyro.conf.DisallowNone] = None
    """tokens sampled per completion in evaluation (default: 12 on the built-in task; on a dataset, the longest
    completion of the 8 held-out examples it samples)"""
    num_train_examples: int = 100_000
    """size of the built-in task's training set"""
    save_every: int = 0
    """write a checkpoint to resume from every this many steps, to runs/<run>/checkpoint-<step> (0: none; SIGTERM
    always writes one, then ends the run)"""
    keep_checkpoints: int = 2
    """keep the last this many checkpoints, deleting older ones"""
    resume: str | None = None
    """resume from this checkpoint-<step> directory, or from the latest in this runs/<run> directory; the other
    flags must be those of the run it continues"""
    lora_r: int = 0
    """LoRA rank: train low-rank adapters on every linear layer instead of all the weights (0: full fine-tuning;
    needs peft). A reference model is then the policy with its adapters off; a scalar head trains whole"""
    lora_alpha: float = 32.0
    """LoRA's α: the adapters' update is scaled by α / r"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    lora_target_modules: tuple[str, ...] = ()
    """the layers to adapt, by name (e.g. q_proj v_proj); none: every linear layer but the output head"""
    merge_lora: bool = False
    """save the adapters merged into the weights, a model that from_pretrained loads alone (else the adapter,
    which peft's PeftModel.from_pretrained puts on the base model)"""

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
    """Every flag checked before any work: one line that says what to change. Under torchrun each rank checks
    the same flags and only rank 0 prints."""
    settle_warmup(args, 100, "cosine")  # --warmup-steps, where not given
    settle_lengths(args, {"max_length": (64, 1024), "max_new_tokens": (12, None)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1, "eval_size": 0,
                        "max_new_tokens": 1, "num_train_examples": 1, "n_layer": 1, "n_embd": 1, "n_head": 1,
                        "gradient_accumulation_steps": 1}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "weight_decay": ">= 0", "max_grad_norm": "> 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % (world_size * args.gradient_accumulation_steps):
        sys.exit(f"error: --batch-size {args.batch_size} does not split into {world_size} rank(s) × "
                 f"{args.gradient_accumulation_steps} micro-batches; make it a multiple of "
                 f"{world_size * args.gradient_accumulation_steps}")
    if args.save_every < 0 or args.keep_checkpoints < 1:
        sys.exit("error: --save-every must be ≥ 0 and --keep-checkpoints ≥ 1")
    check_lora(args)


# The built-in tiny model's chat template, over ByT5's bytes: `role: content</s>` a turn (EOS ends it), the tools'
# names on a first line, a tool call in Qwen2.5's format with compact JSON; agent_grpo.py's built-in task uses it
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{\"name\":\"{{ c['function']['name'] }}\",\"arguments\":"
    "{{ c['function']['arguments'] | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def main(args: Args):
    settle_defaults(args)  # --bf16 and --gradient-checkpointing, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    checkpoint = find_checkpoint(args, int(os.environ.get("WORLD_SIZE", "1")))  # --resume: checked before any work
    rank, world_size, device = setup_distributed(args.cuda)
    run_dir = run_directory(args, checkpoint, device)  # under torchrun: seen by every rank, or one line
    random.seed(args.seed)  # the data order: the same on every rank
    torch.manual_seed(args.seed + rank)  # sampling: a stream of its own on each rank
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: autocast(device, args)  # noqa: E731  --bf16 without FSDP

    # The tokenizer (fast, and it checks the model path), then the data, tokenized and checked before the model
    if args.model_name_or_path is None:
        from transformers import ByT5Tokenizer

        tokenizer = ByT5Tokenizer()  # a byte-level tokenizer needs no files; pad (0) differs from EOS (1)
        tokenizer.chat_template = BYTE_CHAT_TEMPLATE  # it renders tools; the vocabulary stays ByT5's
    else:
        tokenizer = load_tokenizer(args.model_name_or_path, "pass an existing directory or a hub id")
    stop_ids = stop_token_ids(tokenizer)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_examples, eval_examples = load_data(args, demonstration_row, args.num_train_examples,
                                              [("prompt", "completion"), ("text",), ("messages",)],
                                              "accepts prompt+completion, text, or messages")
    train_examples, eval_examples = add_system_prompt(train_examples, args), add_system_prompt(eval_examples, args)
    train = tokenize_examples(tokenizer, train_examples, stop_ids, args.max_length, "train")
    evals = tokenize_examples(tokenizer, eval_examples, stop_ids, args.max_length, "eval")
    builtin = args.dataset_name is None
    if args.model_name_or_path is None:  # the tiny GPT-2 of the built-in task, from scratch
        from transformers import GPT2Config, GPT2LMHeadModel

        # 256 positions: room for longer prompts and responses in the later stages than --max-length here
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=max(256, args.max_length), n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        raw_model = GPT2LMHeadModel(config)
    else:
        raw_model = load_no_dropout(args.model_name_or_path, "lm", base_dtype(args))  # dropout as the checkpoint has it
    prepare_models(tokenizer, stop_ids, [raw_model])  # raw_model: to sample and save
    sampled = [prompt_length(labels) for _, labels in evals[:8]]  # the prompts of own data's samples
    longest = max([len(data_completion(labels, n)) for (_, labels), n in zip(evals, sampled)], default=1)
    settle_room(args, "max_new_tokens", longest, "the longest completion of the 8 held-out examples sampled",
                (model_positions(raw_model) or math.inf) - max(sampled, default=0))
    if args.gradient_checkpointing:
        raw_model.activation_checkpointing_enable({"use_reentrant": False})
    raw_model = add_lora(raw_model, args)  # --lora-r: adapters on the frozen weights
    model = place_model(raw_model, device, args)  # forward and backward passes
    if args.compile:
        compile_blocks(raw_model)

    writer = make_writer(args, rank, run_dir, checkpoint["step"] if checkpoint else 0)
    print(f"{parameter_count(raw_model)}, {len(train):,} training examples")
    # on CUDA AdamW's fused kernel (one launch for every tensor, TRL's default); on the CPU torch's default
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay, fused=True if device.type == "cuda" else None)
    per_rank = args.batch_size // world_size
    micro_size = per_rank // args.gradient_accumulation_steps
    choose_head(device, args.fsdp, micro_size, args.max_length, raw_model.get_output_embeddings().weight.shape[0])
    eval_batch_size = args.eval_batch_size or micro_size

    def evaluate(step):
        """Each rank evaluates its shard of the eval set; the sums are added up over the ranks."""
        model.eval()
        line = f"step {step}:"
        if evals:  # the loss on held-out examples
            mine, weights = shard(evals, rank, world_size)
            mine = [(ids, labels if w else [-100] * len(labels)) for (ids, labels), w in zip(mine, weights)]
            total, count = 0.0, 0
            with torch.no_grad(), amp():
                for i in range(0, len(mine), micro_size):
                    batch = mine[i : i + micro_size]
                    input_ids, attention_mask, labels = (t.to(device) for t in collate(batch, tokenizer.pad_token_id))
                    logprobs = head_logprobs(model, next_tokens(labels), input_ids=input_ids, attention_mask=attention_mask)
                    total += sft_loss(logprobs, labels, num_items=1).item()  # the summed NLL of the batch
                    count += (labels[:, 1:] != -100).sum().item()
            sums = all_reduce_sum({"nll": total, "tokens": count}, device)
            writer.add_scalar("eval/loss", sums["nll"] / sums["tokens"], step)
            line += f" eval/loss {sums['nll'] / sums['tokens']:.4f}"
        if builtin and eval_examples:  # the gold reward of sampled and greedy completions
            mine, weights = shard(eval_examples, rank, world_size)
            prompts, targets = [ex["prompt"] for ex in mine], [ex["target"] for ex in mine]
            prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
            for name, greedy in (("", False), ("_greedy", True)):
                completions = []
                for i in range(0, len(prompt_ids), eval_batch_size):
                    with amp():
                        sequences, _, width, response_mask, _ = generate(
                            raw_model, prompt_ids[i : i + eval_batch_size], tokenizer.pad_token_id, stop_ids,
                            args.max_new_tokens, greedy=greedy)
                    # the text up to the stop token: the stop token and the padding after it are special tokens
                    completions += tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
                if not greedy:
                    sampled = completions
                sums = all_reduce_sum({"correct": sum(w * (c == t) for c, t, w in zip(completions, targets, weights)),
                                       "gold": sum(w * gold_score(c, t) for c, t, w in zip(completions, targets, weights)),
                                       "n": sum(weights)}, device)
                accuracy, score = sums["correct"] / sums["n"], sums["gold"] / sums["n"]
                writer.add_scalar(f"eval/gold_accuracy{name}", accuracy, step)
                writer.add_scalar(f"eval/gold_score{name}", score, step)
                line += f", gold_accuracy{name} {accuracy:.3f}, gold_score{name} {score:.3f}"
            samples = "\n".join(f"    {p} {c!r} (target {t})" for p, c, t in zip(prompts[:8], sampled, targets))
            writer.add_text("eval/samples", samples, step)
        elif evals:  # own data: completions sampled from 8 held-out prompts (the same on every rank), to read
            prompts = [ids[: prompt_length(labels)] for ids, labels in evals[:8]]
            with amp():
                sequences, _, width, _, _ = generate(raw_model, prompts, tokenizer.pad_token_id, stop_ids,
                                                     args.max_new_tokens)
            completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
            samples = samples_text(tokenizer, prompts, completions, [labels for _, labels in evals[:8]])
            writer.add_text("eval/samples", samples, step)
            if step == args.max_steps:  # the run's last lines: what it learned
                line += f"\nheld-out prompts, the completion sampled from each and the data's:\n{samples}"
        if step == min(args.eval_every, args.max_steps):  # once: what the numbers are
            print(f"evaluation: eval/loss over {len(evals):,} held-out examples" + (f"; eval/gold_* of "
                  f"{len(eval_examples):,} prompts, one completion each sampled at temperature 1 (_greedy: the argmax)"
                  if builtin and eval_examples else ""))
        print(line)
        model.train()

    model.train()
    order, position = list(range(len(train))), len(train)
    first_step, elapsed, model_time, tokens_seen = 1, 0.0, 0.0, 0
    if checkpoint is not None:  # the weights, AdamW, every random stream, and where the loop was
        loop = load_checkpoint(checkpoint, model, optimizer)
        first_step, order, position = loop["step"] + 1, loop["order"], loop["position"]
        elapsed, model_time, tokens_seen = loop["elapsed"], loop["model_time"], loop["tokens_seen"]
    preemption = Preemption()
    start_time = time.time() - elapsed  # the speeds count the time before a resume
    progress = Progress(args.max_steps, "steps", args.progress and rank == 0, done=first_step - 1)
    for step in range(first_step, args.max_steps + 1):
        if position + args.batch_size > len(order):  # a new pass over the data, reshuffled
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
        num_items = sum(sum(label != -100 for label in labels[1:]) for _, labels in batch)
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "cosine")
        optimizer.param_groups[0]["lr"] = lr

        # ---- update: this rank's share of the batch, in micro-batches -----------------------------
        tick, losses = time.time(), []
        for m in range(rank * per_rank, (rank + 1) * per_rank, micro_size):
            gradient_sync(model, m + micro_size == (rank + 1) * per_rank)  # once per step, with the last micro-batch
            input_ids, attention_mask, labels = collate(batch[m : m + micro_size], tokenizer.pad_token_id)
            tokens_seen += int(attention_mask.sum())
            # no waiting for the device inside the step: copies that do not wait, the losses read after the backward
            input_ids, attention_mask, labels = (t.to(device, non_blocking=True)
                                                 for t in (input_ids, attention_mask, labels))
            with amp():  # the LM head in chunks (no [batch, length, vocabulary] logits), or whole on a GPU
                logprobs = head_logprobs(model, next_tokens(labels), input_ids=input_ids, attention_mask=attention_mask)
            loss = sft_loss(logprobs, labels, num_items)
            # DDP and FSDP average the ranks' gradients; × world_size turns that into the sum over the whole batch
            (loss * world_size).backward()
            losses.append(loss.detach())
        batch_loss = sum(torch.stack(losses).tolist())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        check_finite(step, loss=batch_loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick

        # ---- log and evaluate -----------------------------------------------------------------------
        if step % 10 == 0:
            elapsed = time.time() - start_time
            sums = all_reduce_sum({"loss": batch_loss, "tokens": tokens_seen}, device)
            writer.add_scalar("losses/loss", sums["loss"], step)
            writer.add_scalar("train/grad_norm", float(grad_norm), step)
            writer.add_scalar("charts/learning_rate", lr, step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", sums["tokens"] / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        progress(step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(step)

        # ---- checkpoint: every --save-every steps, and at SIGTERM, which then ends the run (exit code 0) -----
        sigterm = bool(all_reduce_sum({"sigterm": preemption.received}, device)["sigterm"])  # on any rank
        if sigterm or (args.save_every and step % args.save_every == 0):
            save_checkpoint(run_dir, step, model, optimizer, args, {
                "order": order, "position": position, "elapsed": time.time() - start_time, "model_time": model_time,
                "tokens_seen": tokens_seen}, sigterm)
        if sigterm:
            return writer.close()

    elapsed = time.time() - start_time
    tokens_seen = all_reduce_sum({"tokens": tokens_seen}, device)["tokens"]
    print(f"{args.max_steps * args.batch_size / elapsed:.0f} samples/s, {tokens_seen / elapsed:.0f} tokens/s, "
          f"{100 * model_time / elapsed:.0f}% of the time in forward/backward/optimizer, {elapsed:.0f} s in all")
    save_model(raw_model, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir}")
    writer.close()


# =============================================================================================
# Plumbing: the built-in task, tokenization, data and model loading, forward passes, many processes,
# saving. Each definition below is pasted from the LM scripts that share it, one text in all of them
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
    conversation in another. `text` must be text and `messages` a conversation."""
    kinds, roles = {}, ("system", "developer", "user", "assistant", "tool")
    for column in columns:
        value = row.get(column)
        if value is None:
            return f"no `{column}` (missing or null)"
        if isinstance(value, str) and column != "messages":
            kinds[column] = "text"
        elif isinstance(value, list) and column != "text":
            for j, message in enumerate(value, 1):
                if not isinstance(message, dict):
                    return f"`{column}`, message {j} is a {type(message).__name__}, not a {{role, content}} object"
                if message.get("role") not in roles:
                    return f"`{column}`, message {j}: {message.get('role')!r} is not a role ({', '.join(roles)})"
                if not isinstance(message.get("content"), str) and "tool_calls" not in message:
                    return f"`{column}`, message {j}: its `content` is not text"
            kinds[column] = "a conversation"
        else:
            kind = {"text": "text", "messages": "a list of messages"}.get(column, "text or a list of messages")
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


def add_system_prompt(rows, args):
    """--system-prompt: {"role": "system", "content": args.system_prompt} first in every conversation of the rows
    (a conversational `prompt`; `messages`; or, with no prompt column, both `chosen` and `rejected`, whose
    shared start is the prompt) that does not begin with a system message. Text data has no place for one."""
    if args.system_prompt is None:
        return rows
    if args.dataset_name is None:
        sys.exit("error: --system-prompt needs conversational data; the built-in task is text (pass --dataset-name)")
    system = {"role": "system", "content": args.system_prompt}
    out = []
    for row in rows:
        keys = [k for k in (("prompt",) if "prompt" in row else ("messages", "chosen", "rejected")) if k in row]
        if not all(isinstance(row[k], list) for k in keys):
            sys.exit("error: --system-prompt needs conversational data (lists of role/content messages); this "
                     "dataset is text: write the instruction into the prompts instead")
        out.append({**row, **{k: row[k] if row[k][:1] and row[k][0]["role"] == "system" else [system, *row[k]]
                              for k in keys}})
    return out


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


def load_no_dropout(path, head, dtype, config=None):
    """A checkpoint as a causal LM (head "lm") or with a scalar head (head "score", with a config of num_labels 1:
    a sequence classifier with one label, its head new when the checkpoint has none), its weights in `dtype`
    whatever they were saved in. Trained models take float32 (master weights: in fp16 AdamW's eps underflows
    to 0, in bf16 most small updates round away); --bf16 is the mixed-precision choice on top. Under torchrun
    only rank 0 reads the weights: the other ranks build the model on the meta device (shapes, no memory), and
    place_model gives them rank 0's weights, or under --fsdp only their shards of them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        model_class = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
        if dist.is_initialized() and dist.get_rank() != 0:
            with torch.device("meta"):
                return model_class.from_config(config or AutoConfig.from_pretrained(path), dtype=dtype)
        return model_class.from_pretrained(path, config=config, dtype=dtype)
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


def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels): (input_ids, attention_mask, labels) tensors, labels −100 on padding."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
    return input_ids, attention_mask, labels


HEAD_CHUNK_ELEMENTS = 2**26  # logits made at once by head_logprobs, in float32: 256 MiB
whole_head_elements = 0  # up to this many logits a pass, head_logprobs makes them at once (choose_head sets it)


def choose_head(device, fsdp, rows, positions, vocabulary):
    """How head_logprobs applies the LM head, chosen once and printed. On one GPU (or DDP) without --fsdp, a pass
    whose float32 logits take at most an eighth of the GPU's memory makes them at once and keeps them for the
    backward pass: one matrix product instead of a chunk at a time recomputed in the backward (the kernels the
    host launches are what bounds a step at these sizes). Larger passes, --fsdp (memory first) and the CPU (its
    results unchanged) keep the chunks. `rows` × `positions`: the largest pass of the run."""
    global whole_head_elements
    if device.type == "cuda" and not fsdp:
        whole_head_elements = torch.cuda.get_device_properties(device).total_memory // 8 // 4
    size = f"passes of up to {rows} × {positions} positions: {rows * positions * vocabulary * 4 / 2**30:.2f} GiB"
    if rows * positions * vocabulary <= whole_head_elements:
        print(f"LM head: whole, kept for the backward pass ({size} of float32 logits, within an eighth of the GPU's "
              "memory)")
    else:
        print(f"LM head: in chunks of {max(1, HEAD_CHUNK_ELEMENTS // vocabulary)} positions, recomputed in the "
              f"backward pass ({size} of float32 logits; whole only on a GPU without --fsdp, up to an eighth of "
              "its memory)")


def head_logprobs(model, targets, temperature=1.0, with_entropy=False, **inputs):
    """`model(**inputs)` with its LM head applied a chunk of positions at a time inside the forward pass: log π of
    `targets` ([batch, positions], one per position whose logits the pass computes) as [batch, positions] float32,
    z = head(h) upcast to float32, then divided by the temperature (as `generate` draws tokens), log π = z(target) −
    logsumexp(z); with_entropy, also the entropy H = logsumexp(z) − Σ softmax(z)·z (no gradient unless "grad"). Each chunk's
    logits are recomputed in the backward pass (activation checkpointing), so that no [batch, length, vocabulary]
    tensor exists in any dtype, only [chunk, vocabulary] (torchtune's chunked cross-entropy and Liger's fused linear
    cross-entropy do the same); on a GPU, a pass within choose_head's budget is one chunk, kept for the backward.
    The head still runs inside the model's forward, so DDP, FSDP and autocast see the usual pass. Logit
    softcapping (Gemma 2, 3) is applied in the chunk; a model that changes its logits after the head in another
    way, or an adapted head, stops the run with one line."""
    lm = model.module if isinstance(model, DistributedDataParallel) else model
    lm = getattr(lm, "policy", [lm])[0]  # a LoRA reference (AdaptersOff) computes with its policy's head
    head, config, returned = lm.get_output_embeddings(), lm.config, []
    if not isinstance(head, torch.nn.Linear):
        sys.exit(f"error: the LM head of {type(lm).__name__} is a {type(head).__name__}, not a linear layer; leave it "
                 "out of --lora-target-modules")
    cap = getattr(config, "final_logit_softcapping", None)

    def chunk(h, y):
        z = F.linear(h, head.weight, head.bias).float()
        z = (torch.tanh(z / cap) * cap if cap else z) / temperature
        normalizer = torch.logsumexp(z, -1)
        logprobs = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - normalizer
        if not with_entropy:
            return logprobs
        with torch.set_grad_enabled(with_entropy == "grad" and torch.is_grad_enabled()):
            entropy = normalizer - (torch.softmax(z, -1) * z).sum(-1)
        return torch.stack([logprobs, entropy], -1)

    def forward(hidden):  # [batch, positions, width] → [batch, positions(, 2)]
        n = hidden.shape[0] * hidden.shape[1]
        whole = n * head.weight.shape[0] <= whole_head_elements  # choose_head: made at once, kept for the backward
        size = max(1, n if whole else HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
        grad = not whole and torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        parts = [checkpoint(chunk, h, y, use_reentrant=False) if grad else chunk(h, y)
                 for h, y in zip(hidden.flatten(0, 1).split(size), targets.flatten().split(size))]
        returned.append(torch.cat(parts).view(*hidden.shape[:2], *parts[0].shape[1:]))
        return returned[-1]

    head.forward = forward
    if cap:
        config.final_logit_softcapping = None  # applied in the chunk instead
    try:
        out = model(**{"use_cache": False, **inputs}).logits  # no KV cache unless a caller asks for one
    finally:
        del head.forward
        if cap:
            config.final_logit_softcapping = cap
    if not returned or not (out is returned[0] or torch.equal(out.nan_to_num(), returned[0].nan_to_num())):  # DDP: a copy
        sys.exit(f"error: {type(lm).__name__} changes its logits after the LM head; head_logprobs cannot compute "
                 "its log-probs in chunks")
    return (out[..., 0], out[..., 1]) if with_entropy else out


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
    whose log-probs are trained. A loop of its own rather than transformers' `generate`, for two savings that
    change nothing sampled: each distinct prompt's forward pass runs once, its KV cache shared by the rows that
    repeat it (GRPO's G completions), and a row that has stopped leaves the batch, so that each step costs what
    the rows still running need. Also returns sampler_logprobs: each drawn token's log-probability under the
    distribution it was drawn from (0 on padding), which the sampler holds anyway; RL compares it with the policy
    it trains."""
    device = model.device
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    # Under FSDP: every block gathered once for the whole loop, not once per token
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in sharded:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        # On one GPU the step is a CUDA graph over a preallocated cache; sharded, every rank must step together
        graphed = device.type == "cuda" and not sharded and CACHE == "cache" and model.config._attn_implementation == "sdpa"
        loop = sample_tokens_graphed if graphed else sample_tokens
        responses, sampler_logprobs = loop(model, input_ids, attention_mask, torch.tensor(stop_ids, device=device),
                                           pad_token_id, max_new_tokens, temperature, greedy)
    finally:
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)  # fully_shard's default
    is_stop = torch.isin(responses, torch.tensor(stop_ids, device=device))
    # 1 up to and including the first stop token: a token is valid while no stop token came strictly before it
    response_mask = ((is_stop.cumsum(1) - is_stop.long()) == 0).long()
    length = int(response_mask.sum(1).max())  # the longest response: no later column is anything but padding
    response_mask = response_mask[:, :length]
    responses = responses[:, :length].masked_fill(response_mask == 0, pad_token_id)
    return (torch.cat([input_ids, responses], 1), torch.cat([attention_mask, response_mask], 1), width, response_mask,
            sampler_logprobs[:, :length] * response_mask)


def sample_tokens(model, input_ids, attention_mask, stops, pad_token_id, max_new_tokens, temperature, greedy):
    """The sampling loop of `generate`: [rows, max_new_tokens] tokens, pad_token_id after a row's stop token, and
    the log-probability of each under the distribution it was drawn from."""
    width = input_ids.shape[1]
    distinct, row_prompt = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
    prompt_mask = distinct[:, width:]
    out = model(input_ids=distinct[:, :width], attention_mask=prompt_mask, position_ids=position_ids_of(prompt_mask),
                use_cache=True, logits_to_keep=1)
    cache, logits = out[CACHE], out.logits[row_prompt, -1]
    cache.batch_select_indices(row_prompt)  # each row's copy of its prompt's keys and values
    responses = torch.full((len(input_ids), max_new_tokens), pad_token_id, device=input_ids.device)
    sampler_logprobs = torch.zeros(len(input_ids), max_new_tokens, device=input_ids.device)
    running = torch.arange(len(input_ids), device=input_ids.device)  # the rows still sampling
    positions = attention_mask.sum(1)  # of each row's next token: positions count real tokens only
    for t in range(max_new_tokens):
        if len(running):
            z = logits.float() / temperature
            tokens = z.argmax(-1) if greedy else torch.multinomial(torch.softmax(z, -1), 1).squeeze(1)
            responses[running, t] = tokens
            sampler_logprobs[running, t] = torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1)
            going = ~torch.isin(tokens, stops)
            if not going.all():  # the rows that stopped leave the batch, and their cache with them
                keep = going.nonzero().squeeze(1)
                running, tokens, positions, attention_mask = running[keep], tokens[keep], positions[keep], attention_mask[keep]
                cache.batch_select_indices(keep)
        left = torch.tensor(len(running), device=input_ids.device)
        if dist.is_initialized():  # every rank steps until all are done: a sharded model's forward needs all ranks
            dist.all_reduce(left)
        if t + 1 == max_new_tokens or left == 0:
            break
        if not len(running):  # done here, not elsewhere: one throwaway step keeps the ranks in step
            model(input_ids=input_ids[:1, -1:])
            continue
        attention_mask = F.pad(attention_mask, (0, 1), value=1)
        logits = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=(positions + t)[:, None],
                       use_cache=True, **{CACHE: cache}).logits[:, -1]
    return responses, sampler_logprobs


def sample_tokens_graphed(model, input_ids, attention_mask, stops, pad_token_id, max_new_tokens, temperature, greedy,
                          graph=True, check_every=16):
    """The sampling loop of `generate` on CUDA, as fast as the GPU allows: the KV cache allocated once for the
    whole rollout (transformers' StaticCache), the one-token step recorded once as a CUDA graph and replayed (one
    launch for the whole model instead of hundreds), tokens drawn on the device (`draw_tokens`), and the finished
    rows looked at every `check_every` steps, so that no step waits for the host. A row that stopped steps on
    padding until all have. The same distribution as `sample_tokens`, drawn with other random numbers; with
    graph=False (tests on the CPU) the same steps run one by one. Not under FSDP (`generate`), nor for a model
    with sliding-window layers (Mistral's, Gemma 2's), whose cache keeps a rolling window that these masks do
    not describe: those take `sample_tokens`."""
    rows, width = input_ids.shape
    device, length = input_ids.device, width + max_new_tokens
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    if any(layer.is_sliding for layer in cache.layers):
        return sample_tokens(model, input_ids, attention_mask, stops, pad_token_id, max_new_tokens, temperature, greedy)
    keys = F.pad(attention_mask, (0, max_new_tokens)).bool()  # the keys each row attends to, one more each step
    causal = torch.ones(width, length, dtype=torch.bool, device=device).tril()
    # A padding position attends to itself: a query with no key at all would put NaN in the cache
    prompt_mask = (keys[:, None, :] & causal) | torch.eye(width, length, dtype=torch.bool, device=device)
    logits = model(input_ids=input_ids, attention_mask=prompt_mask[:, None], position_ids=position_ids_of(attention_mask),
                   use_cache=True, logits_to_keep=1, **{CACHE: cache}).logits[:, -1]
    token = torch.full((rows, 1), pad_token_id, device=device)  # the step's inputs, updated in place
    position = attention_mask.sum(1, keepdim=True) - 1  # positions count real tokens only
    step = lambda: model(input_ids=token, attention_mask=keys[:, None, None, :], position_ids=position,  # noqa: E731
                         use_cache=True, **{CACHE: cache}).logits[:, -1]
    responses = torch.full((rows, max_new_tokens), pad_token_id, device=device)
    sampler_logprobs = torch.zeros(rows, max_new_tokens, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        tokens, sampler_logprobs[:, t] = draw_tokens(logits, temperature, greedy)
        tokens = tokens.masked_fill(done, pad_token_id)
        responses[:, t] = tokens
        done |= torch.isin(tokens, stops)
        if t + 1 == max_new_tokens or (t + 1) % check_every == 0 and done.all():
            break
        token.copy_(tokens[:, None])
        keys[:, width + t] = True
        position += 1
        if not graph:
            logits = step()
        elif t == 0:  # the first step runs as usual (on a side stream, as capture asks), then is recorded
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = step()
            torch.cuda.current_stream().wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                graph_logits = step()
        else:
            cuda_graph.replay()
            logits = graph_logits
    return responses, sampler_logprobs


def draw_tokens(logits, temperature, greedy):
    """One token per row from softmax(logits / T) in float32 (the argmax if greedy), with no host sync: the argmax
    of p / E with E ~ Exp(1) (the exponential race) draws index i with probability p_i, as torch.multinomial
    does, without multinomial's checks of its input on the host. Returns (tokens, their log-probabilities)."""
    z = logits.float() / temperature
    tokens = z.argmax(-1) if greedy else (torch.softmax(z, -1) / torch.empty_like(z).exponential_()).argmax(-1)
    return tokens, torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1)


# ---------------------------------------------------------------------------------------------
# Many processes. `torchrun --nproc-per-node N X.py` starts one process (rank) per device; each takes
# its share of every batch, and the gradients are averaged. Under plain `python X.py` these helpers
# change nothing.
# ---------------------------------------------------------------------------------------------
# How long a rank waits in a collective for the others: long enough for rank 0 to gather and write a
# checkpoint of an 8B model (16-32 GB) while the others wait to hear whether it worked (NCCL's default: 10 min).
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


def setup_distributed(cuda):
    """(rank, world_size, device). Under torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK, join the
    process group: NCCL with one GPU per process, or gloo on the CPU. Ranks other than 0 print nothing (an
    error that stops the run is one line from the first rank of each node). On CUDA: float32 matrix products in TF32,
    and PyTorch's expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation as shapes vary
    if torch.cuda.is_available() and cuda:
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 products in TF32 (Ampere and later)
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() and cuda else "cpu")
    if torch.cuda.is_available() and cuda:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's; a launcher may not set it
        if local_world_size > torch.cuda.device_count():  # one GPU per process
            sys.exit(f"error: {local_world_size} processes on this node and {torch.cuda.device_count()} "
                     f"GPU(s): run --nproc-per-node {torch.cuda.device_count()}, or --no-cuda to run on the CPU")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=PROCESS_GROUP_TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")
    return dist.get_rank(), dist.get_world_size(), device


def autocast(device, args):
    """--bf16 as torch.autocast: matrix products in bfloat16 over float32 weights. Off under FSDP, whose
    MixedPrecisionPolicy (place_model) casts the weights themselves: autocast there would keep a bfloat16
    copy of every gathered weight, the full-size copy that sharding is there to avoid."""
    enabled = args.bf16 and not (args.fsdp and dist.is_initialized())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def place_model(model, device, args, trained=True):
    """Put a model on the device. In one process: moved there whole. Under torchrun, rank 0 holds the weights
    (load_no_dropout built the model on the meta device elsewhere; a model built from scratch, or a new scalar head,
    starts from other random values on each rank) and the others receive them. Without --fsdp: a full copy per
    rank, and a trained model in DDP (gradients averaged in the backward pass). With --fsdp: FSDP2 shards the
    model first, then each rank receives only its shard of every weight from rank 0's copy, which is then freed
    (set_model_state_dict's broadcast_from_rank0): no rank but 0 ever holds the whole model, and rank 0 one at
    a time when the models are placed as they are loaded. Each transformer block is gathered only while it
    computes; a frozen model's root (embeddings, LM head) is resharded after its forward too, which FSDP2 skips
    for a root that expects its backward next. With --bf16, FSDP's MixedPrecisionPolicy: the weights are
    gathered and computed with in bfloat16 and the gradients reduced in float32, the kept weights and AdamW
    state float32. Buffers outside the state dict (rotary inv_freq) come from rank 0 too. Build the optimizer
    after this (FSDP2 replaces the parameters)."""
    if not dist.is_initialized():
        return model.to(device)
    full = model.state_dict() if dist.get_rank() == 0 and args.fsdp else {}  # rank 0's weights, on its CPU
    if args.fsdp:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
        block_names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        model = fully_shard(model, mesh=mesh, mp_policy=policy)
        if not trained:
            model.register_forward_hook(lambda module, inputs, output: module.reshard())
    if dist.get_rank() == 0:
        model.to(device)
    else:  # room for the weights (or shards) on the device, their values to come
        tied = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            tied.setdefault(parameter, []).append(name)
        model.to_empty(device=device)
        for first, *others in tied.values():  # to_empty gives each name a tensor of its own: tie them again
            for name in others:
                module, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(module), attribute, model.get_parameter(first))
    if args.fsdp:  # each rank copies its shard of each tensor rank 0 sends
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    else:  # a full copy on every rank: straight into its tensors, no temporary copies
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    if args.fsdp or not trained:
        return model
    config = next(m.config for m in model.modules() if hasattr(m, "config"))
    # a mixture of experts routes each batch to some experts only: where each expert is a module of its own,
    # the others get no gradient this step (transformers 5.23 fuses a layer's experts: not needed there)
    moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=moe)


def compile_blocks(model):
    """--compile: torch.compile each transformer block (the classes a Hugging Face model names in its
    _no_split_modules, the blocks FSDP2 shards) for the passes that compute gradients. Passes without gradients
    (sampling, whose decode step on CUDA is a graph of its own, and the scoring and evaluation passes) keep the
    eager blocks. The blocks of a class share one compiled function; a new sequence length compiles it once more,
    with dynamic shapes from then on."""
    names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    compiled = {}
    for block in [module for module in model.modules() if type(module).__name__ in names]:
        if type(block) not in compiled:
            compiled[type(block)] = torch.compile(type(block).forward)
        block.forward = functools.partial(compiled_or_eager, compiled[type(block)], block)


def compiled_or_eager(compiled, block, *args, **kwargs):
    """A block's forward under --compile: compiled where it computes gradients, eager elsewhere."""
    return (compiled if torch.is_grad_enabled() else type(block).forward)(block, *args, **kwargs)


def gradient_sync(model, enabled):
    """Whether the next backward passes of a DDP model average the gradients over the ranks: off for every
    micro-batch of an optimizer step but the last, so that the gradients cross the network once per step.
    FSDP2 keeps reducing every micro-batch: each rank holds only its shard of the gradients, where skipping
    the reduction would hold the whole float32 gradient (32 GB at 8B) on every rank until the last one."""
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled


def shard(items, rank, world_size):
    """This rank's share of an evaluation list, items[rank::world_size], padded with copies of items[0] to the
    same length on every rank, and a weight per entry (0 on the copies): a sharded model needs every rank in
    each forward pass, so every rank must run as many. Metrics are weighted sums, added up over the ranks."""
    mine = items[rank::world_size]
    padding = -(-len(items) // world_size) - len(mine)
    return mine + items[:1] * padding, [1] * len(mine) + [0] * padding


def all_reduce_sum(sums, device):
    """{name: number} with each number summed over the ranks (the numbers themselves in one process), in one
    all-reduce: per-rank sums and counts become global ones, read back by name."""
    values = [float(v) for v in sums.values()]
    if dist.is_initialized():
        total = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        values = total.tolist()
    return dict(zip(sums, values))


class NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0: only rank 0 writes TensorBoard logs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def make_writer(args, rank, run_dir, start_step=0):
    """TensorBoard's writer for run_dir on rank 0 (a NoWriter elsewhere), the flags logged as a table. A resumed
    run (start_step > 0) appends to its run's logs and drops what they hold after start_step (purge_step): the
    steps a preempted run took after its last checkpoint are taken again."""
    if rank != 0:
        return NoWriter()
    writer = SummaryWriter(run_dir, purge_step=start_step + 1 if start_step else None)
    if not start_step:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer


def run_directory(args, checkpoint, device):
    """run_name's directory (rank 0's clock, on every rank), or the run directory of the checkpoint that
    --resume continues. Under torchrun every rank must see it: each writes its shard of a checkpoint there (SIGTERM
    writes one even without --save-every) and rank 0 renames the whole. So rank 0 writes a file there that every
    rank reads, and a rank that does not see it (several nodes without a shared filesystem) stops the run on every
    node with one line, before any training."""
    run_dir = [os.path.dirname(checkpoint["path"]) if checkpoint is not None else run_name(args)]
    if not dist.is_initialized():
        return run_dir[0]
    dist.broadcast_object_list(run_dir, src=0)
    run_dir, probe, token = run_dir[0], os.path.join(run_dir[0], "every-rank-sees-this"), str(time.time())
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write(token)
    token = [token]
    dist.broadcast_object_list(token, src=0)  # after rank 0 wrote the file
    try:
        with open(probe) as f:
            seen = f.read() == token[0]
    except OSError:
        seen = False
    blind = int(all_reduce_sum({"blind": not seen}, device)["blind"])
    if dist.get_rank() == 0:
        os.remove(probe)
        if blind and checkpoint is None and not os.listdir(run_dir):
            os.rmdir(run_dir)
    if blind:
        sys.exit(f"error: {blind} of {dist.get_world_size()} ranks do not see the run directory {run_dir!r}, where "
                 "every rank writes its share of a checkpoint: start every node from one directory on a filesystem "
                 "they share (runs/ is made there)" if os.environ.get("LOCAL_RANK", "0") == "0" else 1)
    return run_dir


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
    """The defaults that depend on where the run is, settled before any work (and logged and checkpointed as
    settled). --bf16: on where CUDA computes and has bfloat16, as in TRL's configs (bf16 unless fp16); off on the
    CPU, where bfloat16 products are slower than float32 on most processors. --gradient-checkpointing: on under
    --fsdp, the runs of models whose every block's activations do not fit beside the weights."""
    if args.bf16 is None:
        args.bf16 = args.cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = args.fsdp


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
    """Save a Hugging Face model (the one inside any DDP wrapper), its weights in `dtype` (save_dtype_of), so
    that a crash never leaves a half-written checkpoint: rank 0 writes to a temporary directory, then renames
    it. Every rank calls this: under FSDP they first gather the full weights (to rank 0's CPU memory), and all
    learn whether the write worked: if not, every node says so in one line and nothing is left half-written.
    On several nodes without a shared filesystem the checkpoint is on the first node only: the others say so.
    A LoRA model (--lora-r) is saved as its adapter (and trained head) in float32, which peft's
    PeftModel.from_pretrained puts back on the base model; with --merge-lora, merged into the weights."""
    if args.lora_r:
        if args.merge_lora:
            model = model.merge_and_unload()  # W₀ + (α/r) B A: a plain model of the base's architecture
        else:
            dtype = torch.float32
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state_dict = model.state_dict()
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        # a tied weight once, under its first name; floating-point weights in the dtype asked for
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items() if k in names}
        tmp_dir = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
        try:
            model.save_pretrained(tmp_dir, state_dict=state_dict)
            if os.path.exists(os.path.join(tmp_dir, "config.json")):  # not in an adapter's directory
                with open(os.path.join(tmp_dir, "config.json")) as f:
                    config = json.load(f)
                with open(os.path.join(tmp_dir, "config.json"), "w") as f:  # the dtype the weights are saved in
                    json.dump({**config, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
            tokenizer.save_pretrained(tmp_dir)
            with open(os.path.join(tmp_dir, "training_args.json"), "w") as f:
                json.dump(vars(args), f, indent=2)
            if os.path.exists(output_dir):
                shutil.rmtree(output_dir)
            os.replace(tmp_dir, output_dir)
        except OSError as e:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            problem = f"error: cannot write the checkpoint to {output_dir!r}: {e}; nothing was saved"
    # rank 0's outcome, known to every rank
    if all_reduce_sum({"failed": problem is not None}, next(model.parameters()).device)["failed"] and problem is None:
        problem = f"error: rank 0 could not write the checkpoint to {output_dir!r} (its line says why); nothing was saved"
    if problem is not None:
        sys.exit(problem)
    if os.environ.get("LOCAL_RANK", "0") == "0" and not os.path.isdir(output_dir):
        print(f"note: the checkpoint {output_dir!r} is on the first node only (this node does not share its "
              "filesystem): copy it from there", file=sys.stderr)


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


# ---------------------------------------------------------------------------------------------
# LoRA (--lora-r): low-rank adapters on frozen weights, through peft, which is imported only then
# ---------------------------------------------------------------------------------------------
def check_lora(args):
    """The LoRA flags, checked before any work (part of every LM script's check_args)."""
    if args.lora_r < 0 or (args.lora_r and (args.lora_alpha <= 0 or not 0 <= args.lora_dropout < 1)):
        sys.exit("error: --lora-r must be ≥ 0, --lora-alpha > 0 and --lora-dropout in [0, 1)")
    if args.merge_lora and not args.lora_r:
        sys.exit("error: --merge-lora merges LoRA adapters into the weights; pass --lora-r too")
    if args.lora_r and args.fsdp:
        sys.exit("error: --lora-r with --fsdp is not supported; drop --fsdp (LoRA trains few weights: DDP holds their "
                 "AdamW state easily, and --bf16 keeps the frozen base in bfloat16)")
    if args.lora_r and importlib.util.find_spec("peft") is None:
        sys.exit("error: --lora-r needs peft: pip install peft")


def base_dtype(args):
    """The dtype of a trained model's weights: float32 for full fine-tuning (master weights for AdamW); with LoRA
    and --bf16, bfloat16: nothing updates them, so they are held as they are computed with (half the memory)."""
    return torch.bfloat16 if args.lora_r and args.bf16 else torch.float32


def add_lora(model, args):
    """--lora-r > 0: LoRA (Hu et al. 2021, eq. 3), h = W₀x + (α/r)·B·A·x on every linear layer but the output
    head (or those of --lora-target-modules), W₀ frozen. B starts at 0, so the model computes exactly what it
    did until the first update. A scalar head (a reward model's, a critic's) is new or task-specific: it trains
    whole. The trained weights are float32 whatever the base's dtype. Without --lora-r: `model` unchanged."""
    if not args.lora_r:
        return model
    from peft import LoraConfig, get_peft_model

    heads = [name for name, _ in model.named_children() if name != model.base_model_prefix]
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=list(args.lora_target_modules) or "all-linear",
                        modules_to_save=heads if type(model).__name__.endswith("ForSequenceClassification") else None)
    with warnings.catch_warnings():  # GPT-2's Conv1D layers: peft transposes them itself and says so
        warnings.filterwarnings("ignore", "fan_in_fan_out")
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")  # peft 0.21 on transformers 5
        model = get_peft_model(model, config)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model


def parameter_count(*models):
    """"N parameters (M trained)" of the models together: what LoRA saves is in the second number."""
    params = {id(p): p for model in models for p in model.parameters()}.values()  # a shared weight once
    return f"{sum(p.numel() for p in params):,} parameters ({sum(p.numel() for p in params if p.requires_grad):,} trained)"


# ---------------------------------------------------------------------------------------------
# Long runs: checkpoints that resume exactly, and SIGTERM. A checkpoint is the directory
# runs/<run>/checkpoint-<step>: the trained weights and AdamW state (torch.distributed.checkpoint: under
# --fsdp each rank writes and reads its own shards, nothing is gathered), each rank's random streams and
# the loop's state (rank<r>.pt), and checkpoint.json (script, step, ranks, flags).
# ---------------------------------------------------------------------------------------------
# The flags a resumed run may change: where things go, not what is computed
CHANGEABLE_ON_RESUME = ("exp_name", "output_dir", "resume", "save_every", "keep_checkpoints", "progress")
# Frozen weights are not saved (they are reloaded from the model path): with LoRA a checkpoint is the adapters
CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def find_checkpoint(args, world_size):
    """The checkpoint --resume names (a checkpoint-<step> directory, or a run directory: its latest), checked
    before any work: one of this script, saved with the same flags and as many ranks. Returns its
    checkpoint.json with its "path", or None without --resume."""
    if args.resume is None:
        return None
    path = args.resume.rstrip("/")
    if not os.path.isfile(os.path.join(path, "checkpoint.json")):
        steps = [int(name[len("checkpoint-") :]) for name in (os.listdir(path) if os.path.isdir(path) else [])
                 if re.fullmatch(r"checkpoint-\d+", name) and os.path.isfile(os.path.join(path, name, "checkpoint.json"))]
        if not steps:
            sys.exit(f"error: --resume {args.resume}: no checkpoint there; pass a runs/<run> directory that holds "
                     "checkpoint-<step> directories (written with --save-every, or at SIGTERM), or one of them")
        path = os.path.join(path, f"checkpoint-{max(steps)}")
    with open(os.path.join(path, "checkpoint.json")) as f:
        saved = json.load(f)
    script = os.path.basename(__file__)
    if saved["script"] != script:
        sys.exit(f"error: --resume {path} is a checkpoint of {saved['script']}; resume it with that script, not {script}")
    now = json.loads(json.dumps(vars(args)))  # as checkpoint.json holds them (tuples as lists)
    for name, value in now.items():
        if name not in CHANGEABLE_ON_RESUME and saved["args"].get(name) != value:
            sys.exit(f"error: --{name.replace('_', '-')} is {value} here but {saved['args'].get(name)} in {path}; a "
                     "resumed run takes the flags of the run it continues (only --save-every, --keep-checkpoints, "
                     "--output-dir, --exp-name and --progress may change)")
    if saved["world_size"] != world_size:
        sys.exit(f"error: {path} was saved by {saved['world_size']} rank(s) and this run has {world_size}; resume with "
                 f"{saved['world_size']} (each rank's random streams and share of every batch are part of the checkpoint)")
    return {**saved, "path": path}


def random_streams():
    """This process's random streams: python's, numpy's, torch's on the CPU and on its GPU."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), position, has_gauss, gauss),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}


def set_random_streams(streams):
    random.setstate(streams["python"])
    name, keys, position, has_gauss, gauss = streams["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(streams["torch"])
    if streams["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(streams["cuda"])


def save_checkpoint(run_dir, step, trained, optimizer, args, loop_state, sigterm=False):
    """Write runs/<run>/checkpoint-<step> atomically: every rank writes into checkpoint-<step>.tmp, then rank 0
    renames it and deletes all but the last --keep-checkpoints; a crash mid-write leaves the earlier ones as
    they were. `trained`: the module (as placed: DDP or FSDP) whose trained weights `optimizer` updates;
    `loop_state`: what the loop needs to go on (data position, controllers, counters), with `step`. Every
    rank calls this. A multi-node run needs a filesystem that every node shares (each writes its shards)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(run_dir, f"checkpoint-{step}")
    tmp = f"{path}.tmp"

    def write(part):
        """Run part() on every rank; if it fails on any (a full disk, a permission), every rank stops with one line."""
        problem = None
        try:
            part()
        except Exception as e:  # noqa: BLE001
            problem = f"error: cannot write the checkpoint {path}: {first_line(e)}"
        if all_reduce_sum({"failed": problem is not None}, next(trained.parameters()).device)["failed"]:
            sys.exit(problem or f"error: another rank could not write the checkpoint {path} (rank 0's line says why)")

    def make_directory():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crash during an earlier write left
            os.makedirs(tmp)

    def write_state():
        model_state, optimizer_state = get_state_dict(trained, optimizer, options=CHECKPOINT_OPTIONS)
        with warnings.catch_warnings():  # in one process DCP warns at every call that it assumes one process
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)  # collective
        torch.save({"random": random_streams(), "loop": {**loop_state, "step": step}}, os.path.join(tmp, f"rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp, "checkpoint.json"), "w") as f:
                json.dump({"script": os.path.basename(__file__), "step": step, "args": vars(args),
                           "world_size": dist.get_world_size() if dist.is_initialized() else 1}, f, indent=2)

    write(make_directory)
    write(write_state)
    if rank == 0:  # every rank has written its part: the checkpoint is complete once it has its name
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        steps = sorted(int(name[len("checkpoint-") :]) for name in os.listdir(run_dir) if re.fullmatch(r"checkpoint-\d+", name))
        for old in steps[: -args.keep_checkpoints]:
            shutil.rmtree(os.path.join(run_dir, f"checkpoint-{old}"))
    if dist.is_initialized():
        dist.barrier()  # the checkpoint is complete before any rank goes on (or exits)
    if sigterm:
        argv = sys.argv[1:]  # the same command, --resume pointing at this run
        flags = [a for i, a in enumerate(argv) if not a.startswith("--resume") and (i == 0 or argv[i - 1] != "--resume")]
        launcher = f"torchrun --nproc-per-node {dist.get_world_size()}" if dist.is_initialized() else "python"
        print(f"SIGTERM: stopped after step {step}, checkpoint saved; resume with:\n"
              f"    {launcher} {shlex.join([sys.argv[0], *flags, '--resume', run_dir])}")


def load_checkpoint(checkpoint, trained, optimizer):
    """Restore a checkpoint (find_checkpoint's) into the trained module and its optimizer, placed as they were
    when it was saved, and this rank's random streams; returns the loop's state. Call it right before the
    loop: the random streams go on from here."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model_state, optimizer_state = get_state_dict(trained, optimizer, options=CHECKPOINT_OPTIONS)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=checkpoint["path"])
    except Exception as e:  # noqa: BLE001  another model's weights: missing names, other shapes
        sys.exit(f"error: {checkpoint['path']} does not fit this model ({first_line(e)[:200]}); resume with "
                 "the model it was saved from")
    # strict=False: the frozen weights are not in the checkpoint (dcp.load has failed on any trained one missing)
    set_state_dict(trained, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    saved = torch.load(os.path.join(checkpoint["path"], f"rank{rank}.pt"), weights_only=True)
    set_random_streams(saved["random"])
    print(f"resumed from {checkpoint['path']} (step {saved['loop']['step']})")
    return saved["loop"]


class Preemption:
    """SIGTERM, which Slurm, Kubernetes and cloud schedulers send before they stop a job, noted when it arrives
    and acted on at the next step boundary: the run saves a checkpoint there and exits 0 (a scheduler's grace
    period must cover one step and one checkpoint). torchrun passes the signal to every rank; the loop then
    adds up the ranks' `received`, so that all of them stop after the same step."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self.note)

    def note(self, signum, frame):
        self.received = True


if __name__ == "__main__":
    try:
        main(tyro.cli(Args, description=__doc__))
    except SystemExit as e:  # under torchrun every rank stops on the same bad input: one line per node says so
        if isinstance(e.code, str) and os.environ.get("LOCAL_RANK", "0") != "0":
            # Local rank 0 prints the line. torchrun stops every rank as soon as one fails, so the others
            # wait for it first: exiting at once could stop rank 0 before it has printed.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop must end the wait (Preemption)
            time.sleep(60)
            sys.exit(1)
        if dist.is_initialized():  # a process group left to the exit can abort it ("terminate called ...")
            e.__traceback__ = None  # which holds main's frame: its models go first, as below
            gc.collect()
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        # Only now, with main's models freed: a DDP model that outlives the process group tears gloo down
        # while holding the GIL, which can deadlock with gloo's worker threads.
        gc.collect()
        dist.destroy_process_group()
