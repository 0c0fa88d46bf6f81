"""Reward model (RLHF stage 1b): a Bradley-Terry pairwise model of human preferences.

The SFT model with a scalar head (`AutoModelForSequenceClassification`, num_labels=1) scores a whole
sequence at its last token (the stop token that ends every completion). It is trained so that the
chosen completion of each pair scores above the rejected one (Ouyang et al. 2022, eq. 1; Bradley &
Terry 1952):

    loss = −log σ(r(x, y_chosen) − r(x, y_rejected) − margin)

    python sft.py && python scale/reward_model.py                          # built-in task: ~100 s, then ~80 s on 2 CPU cores
    python scale/reward_model.py --model-name-or-path my-sft --dataset-name trl-lib/ultrafeedback_binarized --lr 1e-5 --bf16

Datasets in TRL's preference formats, text or conversational: `prompt`/`chosen`/`rejected`, or
`chosen`/`rejected` with the prompt inside each; an optional `margin` column. Dropout is off, as in TRL.

The full program. Take it instead of the top-level reward_model.py, the one-device reference, for torchrun (DDP, FSDP2),
LoRA, gradient accumulation and checkpointing, or checkpoints that resume exactly; on one process it computes what
reward_model.py computes (tests/test_tiers.py).
"""
import datetime
import functools
import gc
import importlib.util
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
    model_name_or_path: str = "models/sft"
    """hub id or local directory of the model to start from (sft.py's output by default)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or a .json/.jsonl/.parquet file; None uses the built-in sort task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    system_prompt: str | None = None
    """a system message put first in every conversation of the data that has none (conversational data only)"""
    output_dir: str = "models/reward_model"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    max_steps: int = 600
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """preference pairs per optimizer step, over all ranks: each of N ranks (torchrun) takes batch_size / N of them"""
    gradient_accumulation_steps: int = 1
    """split each rank's share of a batch into this many micro-batches (the same update, less memory)"""
    gradient_checkpointing: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on under --fsdp, else off) recompute activations in the backward pass (less memory, one more forward
    pass of compute)"""
    compile: bool = False
    """torch.compile each transformer block of the trained model for the passes that compute gradients (fewer,
    fused kernels; the first steps pay the compile time; docs/scaling.md measures it)"""
    eval_batch_size: int | None = None
    """pairs per forward pass in evaluation, on each rank (None: training's micro-batch size)"""
    lr: float = 1e-3
    """peak learning rate of AdamW (a pretrained model wants ~1e-5; TRL: learning_rate)"""
    warmup_steps: Annotated[int | None, tyro.conf.DisallowNone] = None
    """linear warmup steps (0: none), then linear decay to 0 (default: 50, or a tenth of --max-steps where that is
    fewer)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """longest prompt + completion in tokens: pairs with a longer side are dropped (and counted) (default: 64 on the
    built-in task, TRL's 1024 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast; FSDP2's
    MixedPrecisionPolicy under --fsdp), weights and AdamW state float32; the scalar head computes in float32"""
    fsdp: bool = False
    """under torchrun, shard the model, its gradients and AdamW state across the ranks (FSDP2) instead of a full
    copy on each (DDP): for models whose training state does not fit one device"""
    center_rewards_coefficient: float | None = None
    """add this × mean((r_chosen + r_rejected)²) to keep rewards centered on 0 (Eisenstein et al. 2023)"""
    eval_every: int = 200
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """held-out pairs, 0 for no evaluation (the built-in task's come from their own random stream)"""
    num_train_pairs: int = 50_000
    """size of the built-in task's training set"""

    save_every: int = 0
    """write a checkpoint to resume from every this many steps, to runs/<run>/checkpoint-<step> (0: none;
    SIGTERM always writes one, then ends the run)"""
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

# ---------------------------------------------------------------------------------------------
# The math: a pure function, checked against hand-computed values in tests/test_reward_model.py
# ---------------------------------------------------------------------------------------------
def bradley_terry_loss(rewards_chosen, rewards_rejected, margin=None, center_rewards_coefficient=None):
    """Pairwise loss of the Bradley-Terry model P(y_c ≻ y_r) = σ(r_c − r_r):

        L = mean( −log σ(r_c − r_r − m) )  [ + c · mean( (r_c + r_r)² ) ]

    The margin m (a `margin` column) asks for a larger gap where the preference is stronger; the
    centering term pins the free offset of the rewards near 0.
    """
    logits = rewards_chosen - rewards_rejected
    if margin is not None:
        logits = logits - margin
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((rewards_chosen + rewards_rejected) ** 2).mean()
    return loss


# ---------------------------------------------------------------------------------------------
# The reward of a sequence: the scalar head at its last token
# ---------------------------------------------------------------------------------------------
def sequence_rewards(scorer, input_ids, attention_mask):
    """One reward per sequence: the scalar head (a TokenScorer, or DDP/FSDP around one) at its last non-pad
    token, the stop token."""
    scores = scorer(input_ids, attention_mask)
    return scores[torch.arange(len(scores), device=scores.device), last_token_index(attention_mask)]


def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels): (input_ids, attention_mask, labels) tensors, labels −100 on padding."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
    return input_ids, attention_mask, labels


def check_args(args):
    """Every flag checked before any work: one line that says what to change. Under torchrun each rank checks
    the same flags and only rank 0 prints."""
    settle_warmup(args, 50, "linear")  # --warmup-steps, where not given
    settle_lengths(args, {"max_length": (64, 1024)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1, "eval_size": 0,
                        "num_train_pairs": 1, "gradient_accumulation_steps": 1}.items():
        if getattr(args, name) < least:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "weight_decay": ">= 0", "max_grad_norm": "> 0",
                       "center_rewards_coefficient": ">= 0"}.items():
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


def main(args: Args):
    settle_defaults(args)  # --bf16 and --gradient-checkpointing, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    checkpoint = find_checkpoint(args, int(os.environ.get("WORLD_SIZE", "1")))  # --resume: checked before any work
    rank, world_size, device = setup_distributed(args.cuda)
    run_dir = run_directory(args, checkpoint, device)  # under torchrun: seen by every rank, or one line
    random.seed(args.seed)  # the data order: the same on every rank
    torch.manual_seed(args.seed + rank)  # a stream of its own on each rank
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: autocast(device, args)  # noqa: E731  --bf16 without FSDP

    # The tokenizer (fast, and it checks the model path) and the data come before the model
    hint = "run `python sft.py` first" if args.model_name_or_path == "models/sft" else "pass an existing directory or a hub id"
    tokenizer = load_tokenizer(args.model_name_or_path, hint)
    stop_ids = stop_token_ids(tokenizer)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, eval_rows = load_data(args, preference_row, args.num_train_pairs,
                                      [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
                                      "needs chosen and rejected (and optionally prompt and margin)")
    train_rows, eval_rows = add_system_prompt(train_rows, args), add_system_prompt(eval_rows, args)
    has_margin = any(row.get("margin") is not None for row in train_rows + eval_rows)
    train_pairs = tokenize_pairs(tokenizer, train_rows, stop_ids, args.max_length, "train")
    eval_pairs = tokenize_pairs(tokenizer, eval_rows, stop_ids, args.max_length, "eval")
    # (chosen sequence, rejected sequence, margin): prompt + completion each, and 0 where a row has no margin
    train = [(p + c, p + r, float(row.get("margin") or 0.0)) for p, c, r, row in train_pairs]
    evals = [(p + c, p + r, float(row.get("margin") or 0.0)) for p, c, r, row in eval_pairs]
    eval_rows = [row for _, _, _, row in eval_pairs]
    raw_model = load_no_dropout(args.model_name_or_path, "score", base_dtype(args), load_config(args.model_name_or_path, "score"))
    prepare_models(tokenizer, stop_ids, [raw_model])  # raw_model: the one to save
    if args.gradient_checkpointing:
        raw_model.activation_checkpointing_enable({"use_reentrant": False})
    raw_model = add_lora(raw_model, args)  # --lora-r: adapters on the frozen weights, the head trained whole
    model = place_model(TokenScorer(raw_model), device, args)  # forward and backward passes
    if args.compile:
        compile_blocks(raw_model)

    def pair_rewards(batch):
        """Chosen and rejected sequences in one forward pass: (r_chosen, r_rejected, margin or None)."""
        sequences = [c for c, _, _ in batch] + [r for _, r, _ in batch]
        # collate's labels go unused: a reward model scores the last token; copied without waiting for the device
        input_ids, attention_mask, _ = (t.to(device, non_blocking=True)
                                        for t in collate([(s, s) for s in sequences], tokenizer.pad_token_id))
        with amp():
            rewards = sequence_rewards(model, input_ids, attention_mask)
        margin = torch.tensor([m for _, _, m in batch], device=device) if has_margin else None
        return rewards[: len(batch)], rewards[len(batch) :], margin

    writer = make_writer(args, rank, run_dir, checkpoint["step"] if checkpoint else 0)
    print(f"{parameter_count(raw_model)}, {len(train):,} training pairs")
    # on CUDA AdamW's fused kernel (one launch for every tensor, TRL's default); on the CPU torch's default
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay, fused=True if device.type == "cuda" else None)

    def evaluate(step):
        """Each rank evaluates its shard of the eval pairs; the sums are added up over the ranks."""
        if not evals:
            return
        model.eval()
        mine, weights = shard(list(zip(evals, eval_rows)), rank, world_size)
        chosen, rejected, margins = [], [], []
        with torch.no_grad():
            for i in range(0, len(mine), eval_batch_size):
                r_c, r_r, margin = pair_rewards([pair for pair, _ in mine[i : i + eval_batch_size]])
                chosen.append(r_c), rejected.append(r_r), margins.append(margin)
        keep = torch.tensor(weights, device=device).bool()
        chosen, rejected = torch.cat(chosen)[keep], torch.cat(rejected)[keep]
        margin = torch.cat(margins)[keep] if has_margin else None
        loss = bradley_terry_loss(chosen, rejected, margin).item() * len(chosen) if len(chosen) else 0.0
        sums = all_reduce_sum({"loss": loss, "correct": (chosen > rejected).sum(), "n": len(chosen)}, device)
        writer.add_scalar("eval/loss", sums["loss"] / sums["n"], step)
        writer.add_scalar("eval/accuracy", sums["correct"] / sums["n"], step)
        line = f"step {step}: eval/loss {sums['loss'] / sums['n']:.4f}, eval/accuracy {sums['correct'] / sums['n']:.3f}"
        if args.dataset_name is None:
            # how well the learned reward tracks the gold one, over every held-out candidate: Pearson's r,
            # from sums that add up over the ranks
            rows = [row for (_, row), w in zip(mine, weights) if w]
            x = torch.cat([chosen, rejected]).double().cpu()
            y = torch.tensor([gold_score(row[k], row["target"]) for k in ("chosen", "rejected") for row in rows]).double()
            s = all_reduce_sum({"n": len(x), "x": x.sum(), "y": y.sum(), "xx": (x * x).sum(), "yy": (y * y).sum(),
                                "xy": (x * y).sum()}, device)
            correlation = ((s["n"] * s["xy"] - s["x"] * s["y"])
                           / math.sqrt((s["n"] * s["xx"] - s["x"] ** 2) * (s["n"] * s["yy"] - s["y"] ** 2)))
            writer.add_scalar("eval/gold_correlation", correlation, step)
            line += f", eval/gold_correlation {correlation:.3f}"
        print(line)
        model.train()

    model.train()
    per_rank = args.batch_size // world_size
    micro_size = per_rank // args.gradient_accumulation_steps
    eval_batch_size = args.eval_batch_size or micro_size
    order, position = list(range(len(train))), len(train)
    first_step, elapsed, model_time, tokens_seen = 1, 0.0, 0.0, 0
    if checkpoint is not None:  # the weights and head, AdamW, every random stream, and where the loop was
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
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "linear")
        optimizer.param_groups[0]["lr"] = lr

        # ---- update: this rank's share of the batch, in micro-batches -----------------------------
        tick, parts = time.time(), []
        for m in range(rank * per_rank, (rank + 1) * per_rank, micro_size):
            gradient_sync(model, m + micro_size == (rank + 1) * per_rank)  # once per step, with the last micro-batch
            r_c, r_r, margin = pair_rewards(batch[m : m + micro_size])
            loss = bradley_terry_loss(r_c, r_r, margin, args.center_rewards_coefficient) / args.gradient_accumulation_steps
            loss.backward()  # the mean over micro-batches = the rank's mean; DDP and FSDP average over the ranks
            parts.append((loss.detach(), r_c.detach(), r_r.detach()))
        loss = sum(p[0] for p in parts)
        r_c, r_r = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        check_finite(step, loss=loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick
        tokens_seen += sum(len(c) + len(r) for c, r, _ in batch[rank * per_rank : (rank + 1) * per_rank])

        # ---- log and evaluate: means over the whole batch, sums added up over the ranks -------------
        if step % 10 == 0:
            elapsed = time.time() - start_time
            sums = all_reduce_sum({"loss": loss, "correct": (r_c > r_r).sum(), "chosen": r_c.sum(),
                                   "rejected": r_r.sum(), "tokens": tokens_seen}, device)
            writer.add_scalar("losses/loss", sums["loss"] / world_size, step)
            writer.add_scalar("train/grad_norm", float(grad_norm), step)
            writer.add_scalar("train/accuracy", sums["correct"] / args.batch_size, step)
            writer.add_scalar("train/reward_chosen", sums["chosen"] / args.batch_size, step)
            writer.add_scalar("train/reward_rejected", sums["rejected"] / args.batch_size, step)
            writer.add_scalar("train/margin", (sums["chosen"] - sums["rejected"]) / args.batch_size, step)
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
    print(f"{args.max_steps * args.batch_size / elapsed:.0f} pairs/s, {tokens_seen / elapsed:.0f} tokens/s, "
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


def candidate(rng, target):
    """A candidate for preference pairs: the target, or with probability 0.5 one or two corruptions."""
    if rng.random() < 0.5:
        return target
    for _ in range(rng.randint(1, 2)):
        target = corrupt(rng, target)
    return target


def preference_row(rng):
    """A row of the reward model's and DPO's data: two candidates for one prompt with different gold scores,
    the better one chosen."""
    prompt, target = make_prompt(rng)
    while True:
        a, b = candidate(rng, target), candidate(rng, target)
        if gold_score(a, target) != gold_score(b, target):
            chosen, rejected = (a, b) if gold_score(a, target) > gold_score(b, target) else (b, a)
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "target": target}


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


def tokenize_preference(tokenizer, row, stop_ids):
    """(prompt_ids, chosen_ids, rejected_ids) of a preference row in any of TRL's formats: explicit
    (`prompt`, `chosen`, `rejected`) or implicit (`chosen` and `rejected` each include the prompt), text or
    conversational. An implicit prompt is what the two share at the start, as in TRL: whole messages of
    a conversation, whole tokens of a text (so a word is never split and keeps its leading space)."""
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if not prompt and isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif not prompt:
        c, r = encode_prompt(tokenizer, chosen), encode_prompt(tokenizer, rejected)
        n = len(os.path.commonprefix([c, r]))
        return c[:n], c[n:] + [tokenizer.eos_token_id], r[n:] + [tokenizer.eos_token_id]
    prompt_ids, chosen_ids = tokenize_pair(tokenizer, prompt, chosen, stop_ids)
    return prompt_ids, chosen_ids, tokenize_pair(tokenizer, prompt, rejected, stop_ids)[1]


def tokenize_pairs(tokenizer, rows, stop_ids, max_length, split):
    """[(prompt_ids, chosen_ids, rejected_ids, row)] of the preference rows that fit `max_length`: a pair whose
    longer side does not fit, or whose sides are the same tokens, is dropped (and counted) rather than cut, so
    no fake EOS and no zero-gradient pair is trained on."""
    kept, too_long, same, lengths = [], 0, 0, []
    for row in rows:
        prompt_ids, chosen_ids, rejected_ids = tokenize_preference(tokenizer, row, stop_ids)
        lengths.append(len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)))
        if lengths[-1] > max_length:
            too_long += 1
        elif chosen_ids == rejected_ids:
            same += 1
        else:
            kept.append((prompt_ids, chosen_ids, rejected_ids, row))
    if too_long or same:
        print(f"{split}: dropped {too_long:,} of {len(rows):,} pairs longer than --max-length {max_length} (the "
              f"longest: {max(lengths):,} tokens), {same:,} whose chosen and rejected are the same tokens")
    if not kept and split == "train" and too_long:
        sys.exit(f"error: no training pair fits --max-length {max_length}: they have {min(lengths):,} to "
                 f"{max(lengths):,} tokens; raise --max-length (TRL's default: 1024)")
    if not kept and split == "train":
        sys.exit("error: no training pair is left (see above); check the data")
    return kept


# ---------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------
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


def dropout_off(config):
    """Every dropout probability of a transformers config set to 0, before the model is built: Llama's and
    Qwen2's attention dropout is no nn.Dropout module but a number each layer reads from the config."""
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def load_config(path, head):
    """A checkpoint's config with every dropout off, for models whose log-probs, values and scores must not be
    random (Llama's attention dropout is a number each layer reads from it); head "score": one label."""
    from transformers import AutoConfig

    try:
        return dropout_off(AutoConfig.from_pretrained(path, **({"num_labels": 1} if head == "score" else {})))
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a model from {path!r}: {first_line(e)}")


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


def position_ids_of(attention_mask):
    """Positions count real tokens only, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask):
    """Index of the last non-pad token of each row, under left or right padding: the largest position
    whose mask is 1 (for right padding, the number of tokens − 1)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def scalar_head(model, sequences, attention_mask):
    """The scalar head of a sequence-classification model on every position: [batch, length], computed in
    float32 (a value or reward is one number: it gets float32's precision, not bfloat16's 3 digits)."""
    if hasattr(model, "get_base_model"):  # a LoRA model (peft): the classifier inside, its adapters in place
        model = model.get_base_model()
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    hidden = model.base_model(input_ids=sequences, attention_mask=attention_mask,
                              position_ids=position_ids_of(attention_mask), use_cache=False).last_hidden_state
    head = model.score
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()).squeeze(-1)


class TokenScorer(torch.nn.Module):
    """scalar_head as a module's forward. DDP and FSDP act in the forward of the module they wrap, so a
    trained scalar head is wrapped in this: its forward, unlike the classifier's own, keeps every position."""

    def __init__(self, classifier):
        super().__init__()
        self.classifier = classifier

    def forward(self, sequences, attention_mask):
        return scalar_head(self.classifier, sequences, attention_mask)


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
