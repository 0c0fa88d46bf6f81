"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024): preference learning from unpaired feedback, each
completion labelled desirable or undesirable (a thumbs up or down): no pairs, no reward model, no sampling in training.

A completion's implied reward is r = β log π_θ(y|x)/π_ref(y|x), as in DPO, and KTO's value of it is judged
against a reference point z₀ = β KL(π_θ ‖ π_ref), estimated on mismatched prompt/completion pairs of the batch
(no gradient through it). Desirable completions should sit above z₀, undesirable ones below (eq. 7):

    L = λ_D (1 − σ(r − z₀))    on a desirable y,        L = λ_U (1 − σ(z₀ − r))    on an undesirable y

with log-probs summed over the completion tokens, π_ref the frozen SFT model. --loss-type apo_zero_unpaired is
APO-zero unpaired (no reference point); --desirable-weight and --undesirable-weight are λ_D and λ_U.

    python sft.py && python reward_model.py && python kto.py         # built-in task, ~3 min on 2 CPU cores
    python kto.py --model-name-or-path my-sft --dataset-name trl-lib/kto-mix-14k --lr 5e-7

Datasets in TRL's unpaired format (prompt, completion, label), or preference pairs, which are unpaired as TRL
does (chosen desirable, rejected undesirable; the two halves of a pair never in one batch). On the built-in task
it is evaluated as dpo.py is (completions sampled on the same prompts, their gold reward, the reward model's score
and the KL to the reference), so the two compare directly. One process, one device; no scale/ sibling yet.
"""
import datetime
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
    model_name_or_path: str = "models/sft"
    """hub id or local directory of the policy's start and the frozen reference (sft.py's output by default; TRL:
    model_name_or_path)"""
    reward_model_path: str | None = "models/reward_model"
    """a reward model used only to report eval/score (skipped when None or missing; must share the policy's tokenizer,
    or, the default, is skipped with one line)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or .json/.jsonl/.parquet file: TRL's unpaired format (prompt, completion,
    label true or false) or preference pairs (unpaired: chosen desirable, rejected undesirable); None: built-in task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/kto"
    """where the trained policy is saved as a Hugging Face checkpoint (atomically)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    loss_type: str = "kto"
    """kto (the paper's, with the reference point z₀) or apo_zero_unpaired (D'Oosterlinck et al. 2024: desirable
    log-ratios pushed up, undesirable down, no z₀)"""
    beta: float = 0.5
    """β: the strength of the implicit KL constraint to the reference (dpo.py's; TRL's default is 0.1, which on the
    built-in task drifts further from the reference and learns less: docs/kto.md)"""
    desirable_weight: float = 1.0
    """λ_D, the weight of a desirable completion's loss (TRL advises λ_D n_D / (λ_U n_U) in [1, 4/3] and says so
    when the data's counts are outside it)"""
    undesirable_weight: float = 1.0
    """λ_U, the weight of an undesirable completion's loss"""
    undesirable_fraction: float | None = None
    """data from pairs only (the built-in task, a preference dataset): the share of training completions that are
    undesirable, the rejected halves of random pairs left out to reach it (0.2: 1 undesirable to 4 desirable; above
    0.5, chosen halves); None: both halves of every pair"""
    max_steps: int = 300
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 128
    """completions per optimizer step (dpo.py's 64 pairs are 128 completions); at least 2, since the reference point
    pairs each prompt with another row's completion"""
    lr: float = 1e-4
    """peak learning rate of AdamW (a pretrained model wants ~5e-7 to 1e-6; TRL: learning_rate)"""
    warmup_steps: Annotated[int | None, tyro.conf.DisallowNone] = None
    """linear warmup steps (0: none), then linear decay to 0 (default: 30, or a tenth of --max-steps where that is
    fewer)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """longest prompt + completion in tokens: longer rows (pairs: with a longer side) are dropped and counted (default:
    64 on the built-in task, TRL's 1024 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast), the policy's weights
    and AdamW state float32; the reference is held and computed as the policy (at the start every r is exactly 0)"""
    num_train_pairs: int = 20_000
    """size of the built-in task's training set, in preference pairs (each two labelled completions)"""
    eval_every: int = 100
    """evaluate every this many steps (and before the first and after the last)"""
    eval_size: int = 512
    """eval prompts / rows (the built-in task's: pairs), 0 for no evaluation (the built-in task's come from their own
    random stream)"""
    response_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """new tokens sampled per completion in evaluation (default: 12 on the built-in task; on a dataset, the longest
    desirable completion of the eval rows)"""
    temperature: float = 1.0
    """sampling temperature in evaluation (1: the trained policy itself)"""
    missing_eos_penalty: float = -3.0
    """eval/score of a sampled completion with no stop token, as in rlhf_ppo.py (reporting only)"""


# ---------------------------------------------------------------------------------------------
# The math: pure functions, checked against hand-computed values in tests/test_kto.py
# ---------------------------------------------------------------------------------------------
def kto_loss(policy_logps, ref_logps, desirable, kl, beta, desirable_weight=1.0, undesirable_weight=1.0,
             loss_type="kto"):
    """KTO's loss (eq. 7) on each completion's log-ratio h = log π_θ(y|x) − log π_ref(y|x), log-probs summed over
    its tokens, the implied reward r = β h and the reference point z₀ = β · kl (kl_estimate):

        kto                 desirable: λ_D (1 − σ(β (h − kl)))     undesirable: λ_U (1 − σ(β (kl − h)))
        apo_zero_unpaired   desirable: λ_D (1 − σ(β h))            undesirable: λ_U σ(β h)

    (APO-zero unpaired, D'Oosterlinck et al. 2024, eq. 7 unpaired), averaged over all the batch's completions as TRL
    averages them. `desirable`: a bool per completion. Returns (loss, rewards): r, detached."""
    h = policy_logps - ref_logps
    if loss_type == "kto":
        losses = torch.where(desirable, 1 - torch.sigmoid(beta * (h - kl)), 1 - torch.sigmoid(beta * (kl - h)))
    elif loss_type == "apo_zero_unpaired":
        losses = torch.where(desirable, 1 - torch.sigmoid(beta * h), torch.sigmoid(beta * h))
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")
    weights = torch.where(desirable, desirable_weight, undesirable_weight)
    return (weights * losses).mean(), beta * h.detach()


def kl_estimate(policy_mismatched_logps, ref_mismatched_logps):
    """z₀ / β, the reference point's KL(π_θ ‖ π_ref) (paper §4.1, TRL's `kl`): on the batch's mismatched pairs
    (x, y') (mismatched_pairs: each y' a completion of another prompt, so the estimate is not the matched
    completions' own log-ratio), max(0, mean(log π_θ(y'|x) − log π_ref(y'|x))), detached: no gradient flows through it."""
    return (policy_mismatched_logps - ref_mismatched_logps).mean().detach().clamp(min=0)


def mismatched_pairs(batch):
    """The pairs kl_estimate reads: each row's prompt with the previous row's completion, the first row's with the
    last's (TRL's rotation of the completions by one within the batch). `batch`: (prompt_ids, completion_ids, ...)."""
    return [(batch[i][0], batch[i - 1][1]) for i in range(len(batch))]


def weight_advice(num_desirable, num_undesirable, desirable_weight, undesirable_weight):
    """TRL's warning, as one line, or None: with unequal counts n_D ≠ n_U the paper (eq. 8) advises
    λ_D n_D / (λ_U n_U) in [1, 4/3]; outside it, the ranges of either weight that bring it back (TRL's rounding)."""
    n_d, n_u = max(num_desirable, 1), max(num_undesirable, 1)
    if n_d == n_u:
        return None
    d_range = (round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2))
    u_range = (round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2))
    if d_range[0] <= desirable_weight <= d_range[1] or u_range[0] <= undesirable_weight <= u_range[1]:
        return None
    return (f"note: {n_d:,} desirable and {n_u:,} undesirable completions: TRL advises λ_D n_D / (λ_U n_U) in [1, 4/3],"
            f" so --desirable-weight in [{d_range[0]}, {d_range[1]}] or --undesirable-weight in [{u_range[0]}, "
            f"{u_range[1]}] (not both)")


def unpaired_batches(pairs, batch_size, rng):
    """One pass over rows 0, 1, ... in random order, in batches of `batch_size` (the last ones may be smaller), no
    batch holding both halves of one pair (`pairs[i]`: row i's pair, None for a row of unpaired data): a row whose
    other half is in the batch being filled waits for the next batch. KTO learns from unpaired feedback, so the two
    halves of a pair are never compared in one step (and never serve as each other's mismatched completion)."""
    order = list(range(len(pairs)))
    rng.shuffle(order)
    batches, taken, waiting = [[]], set(), []
    for i in order:
        waiting.append(i)
        for j in list(waiting):
            if pairs[j] is None or pairs[j] not in taken:
                batches[-1].append(j)
                taken.add(pairs[j])
                waiting.remove(j)
                if len(batches[-1]) == batch_size:
                    batches.append([])
                    taken = set()
    return [batch for batch in batches + [waiting] if batch]  # the waiting rows' other halves are all in the last


def keep_fraction(examples, undesirable_fraction, rng):
    """The examples from pairs, with halves of random pairs left out so that `undesirable_fraction` of them are
    undesirable: of n pairs, every chosen half and the rejected halves of n f / (1 − f) of them (f = 0.2: 1
    undesirable to 4 desirable); above one half, every rejected half and chosen halves of n (1 − f) / f."""
    pairs = sorted({pair for *_, pair in examples})
    cut = undesirable_fraction > 0.5  # the label of the halves left out: False (undesirable) below one half
    share = (1 - undesirable_fraction) / undesirable_fraction if cut else undesirable_fraction / (1 - undesirable_fraction)
    kept = set(rng.sample(pairs, round(len(pairs) * share)))
    return [example for example in examples if example[2] != cut or example[3] in kept]


def completion_logprobs(model, input_ids, attention_mask, labels, temperature=1.0):
    """Σ_t log π(y_t | x, y_<t) over the labeled tokens (labels ≠ −100), one value per sequence, π the softmax of
    logits / temperature."""
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # position t predicts token t + 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_of(attention_mask),
                   use_cache=False).logits  # a pass that does not sample keeps no KV cache (as TRL's trainers)
    return (gather_logprobs(logits / temperature, targets.clamp(min=0)) * (targets != -100)).sum(-1)


def check_args(args):
    """Every flag checked before any work: one line that says what to change."""
    settle_warmup(args, 30, "linear")  # --warmup-steps, where not given
    settle_lengths(args, {"max_length": (64, 1024), "response_length": (12, None)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1, "eval_size": 0,
                        "response_length": 1, "num_train_pairs": 1}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "beta": "> 0", "temperature": "> 0",
                       "desirable_weight": "> 0", "undesirable_weight": "> 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    if args.loss_type not in ("kto", "apo_zero_unpaired"):
        sys.exit(f"error: --loss-type {args.loss_type!r}: choose kto or apo_zero_unpaired")
    if args.loss_type == "kto" and args.batch_size < 2:  # TRL: "KTO will not work properly" with one
        sys.exit("error: --batch-size 1: kto's reference point pairs each prompt with another row's completion, so a "
                 "batch needs at least 2 (with 1 it would be the completion's own reward)")
    if args.undesirable_fraction is not None and not 0 < args.undesirable_fraction < 1:
        sys.exit(f"error: --undesirable-fraction {args.undesirable_fraction}: it must be between 0 and 1")
    if not math.isfinite(args.missing_eos_penalty):  # the score of an unfinished completion: either sign
        sys.exit(f"error: --missing-eos-penalty {args.missing_eos_penalty}: it must be a finite number")


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    random.seed(args.seed)  # the data order
    torch.manual_seed(args.seed)  # the sampling in evaluation
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # The data, the models (policy π_θ, reference π_ref, an optional reward model for evaluation), the eval prompts
    train_rows, eval_rows = load_data(args, preference_row, args.num_train_pairs,
                                      [("prompt", "completion", "label"), ("prompt", "chosen", "rejected"),
                                       ("chosen", "rejected")], "needs prompt, completion and label (TRL's unpaired "
                                      "format), or preference pairs: chosen and rejected (and optionally prompt)")
    if args.undesirable_fraction is not None and "completion" in train_rows[0]:
        sys.exit("error: --undesirable-fraction leaves out halves of preference pairs, and this data is unpaired "
                 "(prompt, completion, label); leave it out, or pass pairs")
    tokenizer, stop_ids, policy, ref, reward = load_models(args, device)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    # each example: (prompt ids, completion ids ending with its stop token, desirable, its pair's index or None)
    train = unpair(tokenizer, train_rows, stop_ids, args.max_length, "train")
    if args.undesirable_fraction is not None:
        train = keep_fraction(train, args.undesirable_fraction, random.Random(args.seed))
    evals = unpair(tokenizer, eval_rows, stop_ids, args.max_length, "eval")
    desirable = sum(label for _, _, label, _ in train)
    if advice := weight_advice(desirable, len(train) - desirable, args.desirable_weight, args.undesirable_weight):
        print(advice)
    eval_prompts, eval_ids, eval_targets = eval_prompts_of(args, tokenizer, [p for p, _, _, _ in evals])
    settle_room(args, "response_length", max([len(c) for _, c, label, _ in evals if label], default=1),
                "the longest desirable completion of the eval rows",
                (model_positions(policy) or math.inf) - max(map(len, eval_ids), default=0))
    # a mismatched pair joins one row's prompt to another's completion: at most the longest of each
    longest = max([max(len(p) for p, _, _, _ in train + evals) + max(len(c) for _, c, _, _ in train + evals)]
                  + [len(p) + args.response_length for p in eval_ids])
    if model_positions(policy) is not None and longest > model_positions(policy):
        sys.exit(f"error: sequences of {longest} tokens (a prompt with the longest completion, or an eval prompt + "
                 f"--response-length) exceed the model's {model_positions(policy)} positions; lower --max-length or "
                 "--response-length")
    groups = len({(i, None) if pair is None else pair for i, (*_, pair) in enumerate(train)})  # a batch: one half each
    if groups < args.batch_size:
        sys.exit(f"error: {len(train):,} training completions ({groups:,} pairs and unpaired rows: a batch holds one half "
                 f"of a pair) fill no batch of --batch-size {args.batch_size}; lower it")

    def logprobs_of(model, pairs):
        """Summed log-probs of each (prompt ids, completion ids)'s completion, in one padded forward pass."""
        input_ids, attention_mask, labels = (t.to(device) for t in collate(
            [(p + c, [-100] * len(p) + c) for p, c in pairs], tokenizer.pad_token_id))
        with amp():
            return completion_logprobs(model, input_ids, attention_mask, labels)

    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"policy: {sum(p.numel() for p in policy.parameters()):,} parameters, {len(train):,} training completions "
          f"({desirable:,} desirable)")
    models = (policy, ref, reward, tokenizer, stop_ids, logprobs_of)
    # the SFT model, before any update
    evaluate(models, evals, eval_prompts, eval_ids, eval_targets, amp, writer, 0, args)
    batches, start_time = [], time.time()
    progress = Progress(args.max_steps, "steps", args.progress)
    for step in range(1, args.max_steps + 1):
        if not batches:  # a new pass over the data, reshuffled; only full batches (the rest waits for the next pass)
            batches = [b for b in unpaired_batches([pair for *_, pair in train], args.batch_size, random)
                       if len(b) == args.batch_size][::-1]
        batch = [train[i] for i in batches.pop()]
        desirable = torch.tensor([label for _, _, label, _ in batch], device=device)
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "linear")
        optimizer.param_groups[0]["lr"] = lr

        # ---- 1. the reference point: KL(π_θ ‖ π_ref) on mismatched pairs, no gradient ----------
        with torch.no_grad():  # the reference on the very tensors the policy sees: every r starts at 0 exactly
            matched, mismatched = [(p, c) for p, c, _, _ in batch], mismatched_pairs(batch)
            if args.loss_type == "kto":
                ref_logps, ref_mismatched = logprobs_of(ref, matched + mismatched).split(len(batch))
                kl = kl_estimate(logprobs_of(policy, mismatched), ref_mismatched)
            else:  # apo_zero_unpaired has no reference point (TRL computes no KL for it and logs 0)
                ref_logps, kl = logprobs_of(ref, matched), torch.zeros((), device=device)
        # ---- 2. update: desirable completions above z₀, undesirable ones below --------------------
        logps = logprobs_of(policy, matched)
        loss, rewards = kto_loss(logps, ref_logps, desirable, kl, args.beta, args.desirable_weight,
                                 args.undesirable_weight, args.loss_type)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        check_finite(step, loss=loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # ---- log and evaluate -----------------------------------------------------------------------
        if step % 10 == 0 or step == 1:  # step 1: before any update (every r is exactly 0)
            # the implied rewards β log π/π_ref of each kind, under dpo.py's tags (TRL: rewards/chosen, ...)
            logs = {"losses/loss": loss.item(), "train/grad_norm": grad_norm, "train/kl": kl.item(),
                    "charts/learning_rate": lr, "charts/samples_per_second": step * len(batch) / (time.time() - start_time)}
            for kind, rows in (("chosen", desirable), ("rejected", ~desirable)):
                if rows.any():
                    logs[f"train/reward_{kind}"] = rewards[rows].mean().item()
                    logs[f"train/logps_{kind}"] = logps[rows].mean().item()
            if desirable.any() and not desirable.all():
                logs["train/margin"] = logs["train/reward_chosen"] - logs["train/reward_rejected"]
            for tag, value in logs.items():
                writer.add_scalar(tag, float(value), step)
        progress(step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(models, evals, eval_prompts, eval_ids, eval_targets, amp, writer, step, args)

    save_model(policy, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


@torch.no_grad()
def evaluate(models, evals, eval_prompts, eval_ids, eval_targets, amp, writer, step, args):
    """The KTO loss on the held-out completions (the reference point of each eval batch's own mismatched pairs),
    and where they come from pairs the implied reward's accuracy on them; then the sampled evaluation of
    rlhf_ppo.py on the eval prompts: completions at --temperature, their KL to the reference, the reward model's
    score and, on the built-in task, their gold reward."""
    policy, ref, reward, tokenizer, stop_ids, logprobs_of = models
    policy.eval()
    line = f"step {step}:"
    if evals:
        # batches as training draws them (a pair's halves apart), in a fixed order: each evaluation sees the same
        batches = unpaired_batches([pair for *_, pair in evals], args.batch_size, random.Random(0))
        losses, pairs = [], {}
        for rows in ([evals[i] for i in b] for b in batches):
            matched, mismatched = [(p, c) for p, c, _, _ in rows], mismatched_pairs(rows)
            logps, ref_logps = logprobs_of(policy, matched), logprobs_of(ref, matched)
            kl = kl_estimate(logprobs_of(policy, mismatched), logprobs_of(ref, mismatched)) \
                if args.loss_type == "kto" else torch.zeros((), device=logps.device)
            desirable = torch.tensor([label for _, _, label, _ in rows], device=logps.device)
            loss, r = kto_loss(logps, ref_logps, desirable, kl, args.beta, args.desirable_weight,
                               args.undesirable_weight, args.loss_type)
            losses.append(loss.item() * len(rows))
            for (_, _, label, pair), value in zip(rows, r.tolist()):
                if pair is not None:
                    pairs.setdefault(pair, {})[label] = value
        writer.add_scalar("eval/loss", sum(losses) / len(evals), step)
        line += f" eval/loss {sum(losses) / len(evals):.4f}"
        ranked = [both[True] > both[False] for both in pairs.values() if len(both) == 2]
        if ranked:  # the implied reward ranks the held-out pairs as dpo.py's eval/accuracy
            writer.add_scalar("eval/accuracy", sum(ranked) / len(ranked), step)
    completions, kls, scores = [], [], []
    for i in range(0, len(eval_ids), args.batch_size):
        with amp():
            sequences, attention_mask, width, response_mask, _ = generate(
                policy, eval_ids[i : i + args.batch_size], tokenizer.pad_token_id, stop_ids, args.response_length,
                args.temperature)
            labels = sequences.masked_fill(F.pad(response_mask, (width, 0)) == 0, -100)  # the response tokens
            kls.append(completion_logprobs(policy, sequences, attention_mask, labels, args.temperature)
                       - completion_logprobs(ref, sequences, attention_mask, labels, args.temperature))
            if reward is not None:
                scores.append(response_scores(reward, sequences, attention_mask, response_mask, stop_ids,
                                              args.missing_eos_penalty)[0])
        # the text up to the stop token: the stop token and the padding after it are special tokens
        completions += tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
    means = {"eval/kl": torch.cat(kls).sum().item() / len(completions)} if completions else {}
    if reward is not None and completions:
        means["eval/score"] = torch.cat(scores).sum().item() / len(completions)
    if eval_targets is not None and completions:
        means["eval/gold_accuracy"] = sum(c == t for c, t in zip(completions, eval_targets)) / len(completions)
        means["eval/gold_score"] = sum(gold_score(c, t) for c, t in zip(completions, eval_targets)) / len(completions)
    for tag, value in means.items():
        writer.add_scalar(tag, value, step)
        line += f", {tag} {value:.3f}"
    writer.add_text("eval/samples", "\n".join(f"    {p} {c!r}" for p, c in zip(eval_prompts[:8], completions)), step)
    if step == 0:  # once: what the numbers are
        print(f"evaluation: eval/loss over {len(evals):,} held-out completions; the rest over {len(eval_ids):,} "
              f"prompts, one completion each sampled at --temperature {args.temperature}")
    print(line)
    if args.dataset_name is not None and step == args.max_steps:  # own data: what it learned
        print_samples(eval_prompts, completions)
    policy.train()


def load_models(args, device):
    """(tokenizer, stop_ids, policy, reference, reward model or None), on the device. The policy in float32
    (master weights) whatever the checkpoint's dtype, the reference as the policy, so that they agree at step 0;
    dropout off in all. The reward model, when there is one, only reports eval/score."""
    path = args.model_name_or_path
    tokenizer = load_tokenizer(path, "run `python sft.py` first" if path == "models/sft" else
                               "pass an existing directory or a hub id")
    stop_ids = stop_token_ids(tokenizer)
    has_reward = bool(args.reward_model_path) and os.path.isdir(args.reward_model_path)
    if has_reward:
        try:
            check_same_vocabulary(tokenizer, load_tokenizer(args.reward_model_path, "pass an existing directory"),
                                  stop_ids, f"the reward model {args.reward_model_path!r} has another tokenizer than "
                                  f"{path!r}; pass --reward-model-path of one trained from this model, or None")
        except SystemExit:  # the default reward model, not asked for: no eval/score rather than no run
            if args.reward_model_path != Args.reward_model_path:
                raise
            if os.environ.get("RANK", "0") == "0":
                print(f"note: {args.reward_model_path} (the default --reward-model-path) has another tokenizer than "
                      f"{path!r}: no eval/score; pass a reward model trained from this model to report it")
            has_reward = False
    has_reward = has_reward and scores_this_data(args)  # a score of the data it was trained for
    policy, ref = load_no_dropout(path, "lm"), load_no_dropout(path, "lm")
    prepare_models(tokenizer, stop_ids, [policy, ref], [ref])
    reward = None
    if has_reward:
        reward = load_no_dropout(args.reward_model_path, "score")
        prepare_models(tokenizer, stop_ids, [reward], [reward])
    return tokenizer, stop_ids, policy.to(device), ref.to(device), reward.to(device) if has_reward else None


def eval_prompts_of(args, tokenizer, eval_pair_prompts):
    """(texts, token ids, gold targets or None) of the prompts the sampled evaluation completes: on the built-in
    task, the eval prompts of sft.py and rlhf_ppo.py, so that the sampled evaluations of all three compare
    directly; with a dataset, each distinct, non-empty prompt of the eval pairs."""
    if args.dataset_name is None:
        rows = task_rows(args.seed, "eval", args.eval_size, prompt_row)
        return ([row["prompt"] for row in rows], [encode_prompt(tokenizer, row["prompt"]) for row in rows],
                [row["target"] for row in rows])
    eval_ids = [list(p) for p in dict.fromkeys(tuple(p) for p in eval_pair_prompts if p)]
    return [tokenizer.decode(p, skip_special_tokens=True) for p in eval_ids], eval_ids, None


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


def prompt_row(rng):
    """A row of the RL stages' data: a prompt and its target, which the gold reward compares with."""
    prompt, target = make_prompt(rng)
    return {"prompt": prompt, "target": target}


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


def unpair(tokenizer, rows, stop_ids, max_length, split):
    """KTO's examples, (prompt_ids, completion_ids, desirable, pair): of unpaired rows (prompt, completion, label),
    pair None; of preference rows, two per pair, the chosen desirable and the rejected undesirable, pair its index
    (TRL's unpair_preference_dataset). A row (a pair) longer than `max_length` is dropped and counted."""
    if rows and "completion" not in rows[0]:
        return [example for k, (p, c, r, _) in enumerate(tokenize_pairs(tokenizer, rows, stop_ids, max_length, split))
                for example in ((p, c, True, k), (p, r, False, k))]
    examples, lengths = [], []
    for row in rows:
        prompt_ids, completion_ids = tokenize_pair(tokenizer, row["prompt"], row["completion"], stop_ids)
        lengths.append(len(prompt_ids) + len(completion_ids))
        if lengths[-1] <= max_length:
            examples.append((prompt_ids, completion_ids, row["label"], None))
    if len(examples) < len(rows):
        print(f"{split}: dropped {len(rows) - len(examples):,} of {len(rows):,} rows longer than --max-length "
              f"{max_length} (the longest: {max(lengths):,} tokens)")
    if not examples and split == "train":
        sys.exit(f"error: no training row fits --max-length {max_length}: they have {min(lengths):,} to "
                 f"{max(lengths):,} tokens; raise --max-length (TRL's default: 1024)")
    return examples


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


def load_no_dropout(path, head):
    """A checkpoint with every dropout off, for models whose log-probs, values and scores must not be random
    (Llama's and Qwen2's attention dropout is no nn.Dropout but a number each layer reads from the config): a
    causal LM (head "lm") or one with a scalar head (head "score": a sequence classifier with one label, its head
    new when the checkpoint has none). Its weights in float32 whatever they were saved in: AdamW needs float32
    master weights (in fp16 its eps underflows to 0, in bf16 most small updates round away); --bf16 is the
    mixed-precision choice on top."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if head == "score" else {}))
        for key, value in list(vars(config).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
        model_class = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
        return model_class.from_pretrained(path, config=config, dtype=torch.float32)
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


def check_same_vocabulary(tokenizer, reward_tokenizer, stop_ids, message):
    """A reward model must read the policy's tokens as the policy does: the same vocabulary, pad token
    included (each tokenizer given its pad token as prepare_models gives it)."""
    add_pad_token(tokenizer, stop_ids)
    add_pad_token(reward_tokenizer, stop_ids)
    if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        sys.exit(f"error: {message}")


def scores_this_data(args):
    """Whether the reward model at --reward-model-path reports eval/score: where it was trained on this run's data
    (its training_args.json; a hub model is taken as given). Trained on other data, the default is skipped and a
    path given is kept, each with one line that says so."""
    trained = reward_model_data(args.reward_model_path)
    if trained in ("", args.dataset_name):
        return True
    default = args.reward_model_path == Args.reward_model_path
    if os.environ.get("RANK", "0") == "0":
        print(f"note: the reward model {args.reward_model_path} was trained on {trained or 'the built-in task'}, not "
              f"on {args.dataset_name or 'the built-in task'}: " + ("no eval/score; pass --reward-model-path of one "
              "trained for this data to report it" if default else "its eval/score scores text it was not trained on"))
    return not default


def reward_model_data(path):
    """The --dataset-name the reward model at `path` was trained on (None: the built-in task), from the
    training_args.json reward_model.py saves beside it; "" where there is none (a hub model: not known)."""
    try:
        with open(os.path.join(path, "training_args.json")) as f:
            return json.load(f).get("dataset_name")
    except (OSError, ValueError):
        return ""


def print_samples(prompts, completions):
    """The last lines of a run on own data, before it saves: 8 held-out prompts (the last 300 characters of each;
    of a conversation, its last message) and the completion sampled from each, to read beside the numbers."""
    print("held-out prompts and the completion sampled from each:")
    for prompt, completion in zip(prompts[:8], completions[:8]):
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        print(f"    {text[-300:]!r} {completion!r}")


def model_positions(model):
    """The longest sequence the model takes, or None when its config does not say."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)


# ---------------------------------------------------------------------------------------------
# Forward passes and sampling
# ---------------------------------------------------------------------------------------------
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


def last_token_index(attention_mask):
    """Index of the last non-pad token of each row, under left or right padding: the largest position
    whose mask is 1 (for right padding, the number of tokens − 1)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def scalar_head(model, input_ids, attention_mask):
    """A sequence classifier's scalar head on every position, [batch, length], computed in float32 (a value or a
    reward is one number: it gets float32's precision, not bfloat16's 3 digits)."""
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_of(attention_mask), use_cache=False).last_hidden_state
    head = model.score
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()).squeeze(-1)


def sequence_rewards(model, input_ids, attention_mask):
    """One reward per sequence: the scalar head at the sequence's last token (the stop token)."""
    scores = scalar_head(model, input_ids, attention_mask)
    return scores[torch.arange(len(scores), device=scores.device), last_token_index(attention_mask)]


def response_scores(reward, sequences, attention_mask, response_mask, stop_ids, missing_eos_penalty):
    """The reward model's score of each sampled sequence (at its last token, the response's stop token);
    `missing_eos_penalty` instead for a response with no stop token in the length sampled (an unfinished answer
    is not scored). Returns (scores, has_stop)."""
    scores = sequence_rewards(reward, sequences, attention_mask)
    responses = sequences[:, -response_mask.shape[1] :]
    has_stop = (torch.isin(responses, torch.tensor(stop_ids, device=responses.device)) & response_mask.bool()).any(1)
    return torch.where(has_stop, scores, torch.full_like(scores, missing_eos_penalty)), has_stop


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
