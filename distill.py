"""On-policy distillation: the student samples its own completions, a frozen teacher scores every token of them,
and the student is trained toward the teacher on exactly the states it visits. With --self-distill the teacher is
the student's own starting weights, reading privileged context (the answer, or a sibling's success) in its prompt.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD,
ICLR 2024), with the generalized Jensen-Shannon divergence between the teacher's and the student's next-token
distributions over the whole vocabulary, at each completion token (section 3, as TRL 1.16's DistillationTrainer):

    M = β π_T + (1 − β) π_S,    JSD_β(π_T ‖ π_S) = β KL(π_T ‖ M) + (1 − β) KL(π_S ‖ M)
    β = 0: KL(π_T ‖ π_S), the forward KL (supervised distillation's);  β = 1: KL(π_S ‖ π_T), the reverse KL

minimized over the tokens of completions the student sampled itself: with probability --lmbda a batch's
completions are the student's, otherwise the dataset's (GKD's λ). --sampled-token is the form of Lu et al. 2025
(Thinking Machines, "On-Policy Distillation"): it needs only the teacher's log-prob of each drawn token, and trains
on k_t = log π_S(x_t) − log π_T(x_t), a one-sample estimate of the reverse KL at that state, as a negative per-token
reward in a policy gradient. The evaluation is the other scripts': gold accuracy on the built-in task's 512
held-out prompts, sampled and greedy.

    python sft.py && python grpo.py                                        # the teacher: models/grpo
    python sft.py --n-layer 1 --n-embd 64 --output-dir models/sft_small    # the student, 91k parameters
    python distill.py                                                      # reverse KL, the whole vocabulary
    python distill.py --beta 0.5                                           # GKD's JSD
    python distill.py --sampled-token                                      # Lu et al.: the drawn token only
    python distill.py --lmbda 0.5 --beta 0.5                               # GKD: half the batches the dataset's
    python distill.py --model-name-or-path models/sft --self-distill       # its own teacher, the target in context
    python distill.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher-model-name-or-path Qwen/Qwen2.5-7B-Instruct --dataset-name prompts.jsonl --lr 1e-6

The student is sft.py's output rather than built here: distillation starts from a supervised model, as RL does,
so grpo.py can train the same student from the same start (docs/distill.md compares the two).
"""

import datetime
import json
import math
import os
import random
import re
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
    model_name_or_path: str = "models/sft_small"
    """hub id or local directory of the student, the model trained (by default sft.py's output with --n-layer 1
    --n-embd 64 --output-dir models/sft_small; TRL: model)"""
    teacher_model_name_or_path: str = "models/grpo"
    """hub id or local directory of the frozen teacher, which must share the student's tokenizer (grpo.py's output
    by default; TRL: teacher_model_name_or_path)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or .json/.jsonl/.parquet file with a `prompt` column (text or
    conversational), and a `completion` column for --lmbda below 1; None: built-in task (its completions: the
    targets)"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to draw prompts from"""
    output_dir: str = "models/distill"
    """where the trained student is saved as a Hugging Face checkpoint (atomically)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    num_iterations: int = 480
    """sample-then-step rounds, one optimizer step on each batch sampled (TRL's DistillationTrainer: one generation
    batch per optimizer step); 480 × 64 completions, as many as grpo.py's defaults sample (120 × 256)"""
    batch_size: int = 64
    """completions per iteration and per optimizer step (TRL: per_device_train_batch_size)"""
    lr: float = 1e-4
    """AdamW learning rate (a pretrained model wants ~1e-6, TRL's default; TRL: learning_rate)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over the iterations"""
    response_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """new tokens sampled per completion; the dataset's completions are cut to it (TRL: max_completion_length)
    (default: 12 on the built-in task; on a dataset, TRL GKD's max_new_tokens 128, cut to what the model's
    positions leave)"""
    max_prompt_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """prompts longer than this many tokens are dropped (and counted), never cut (default: 64 on the built-in task,
    512 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast), the student's weights
    and AdamW state float32; the divergence in float32"""
    temperature: float = 1.0
    """sampling temperature; both models' logits are divided by it in the divergence too (TRL's)"""
    beta: float = 1.0
    """β of the generalized JSD: 0 the forward KL(π_T ‖ π_S), 0.5 the JSD, 1 the reverse KL(π_S ‖ π_T), TRL's
    default (generalized_jsd)"""
    lmbda: float = 1.0
    """λ: the probability that a batch's completions are the student's own; otherwise the dataset's (GKD; TRL's
    GKDTrainer: lmbda, 0.5 there; its DistillationTrainer is on-policy: 1)"""
    sampled_token: bool = False
    """Lu et al. 2025: train on the reverse KL of the drawn token only, as a per-token reward of a policy gradient
    (sampled_token_loss), not on the divergence over the vocabulary; needs --beta 1 and --lmbda 1"""
    self_distill: bool = False
    """self-distillation (OPSD, SDFT, SDPO): the teacher is the student's own starting weights, its prompt with
    privileged context (--teacher-context), the student's the prompt alone; --teacher-model-name-or-path is not read"""
    teacher_context: str = "answer"
    """with --self-distill: `answer`, the row's reference answer (`completion`, else `target`: OPSD, SDFT), or
    `success`, another of the prompt's --num-generations completions that is exactly that answer (SDPO; a completion
    with no such sibling has no loss)"""
    teacher_prompt_template: str = "{prompt}\n\n{privileged_context}"
    """the teacher's prompt under --self-distill (TRL's SDFT name and default)"""
    teacher_update_rate: float = 0.0
    """τ: with --self-distill, after each step θ_T ← (1 − τ) θ_T + τ θ_S (TRL's SDPO: an EMA teacher, 0.05); 0: the
    starting weights throughout (TRL's SDFT: `base`)"""
    num_generations: int = 1
    """completions per prompt, in adjacent rows: a batch holds --batch-size / G prompts"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    eval_every: int = 80
    """evaluate every this many iterations (and before the first and after the last): every 5,120 completions at
    the defaults, as grpo.py's every 20 iterations"""
    eval_size: int = 512
    """eval prompts, 0 for no evaluation: the built-in task's are grpo.py's; a dataset's are its `test` split, or
    else prompts held out from the training ones"""
    eval_num_samples: int = 1
    """n: the student's completions sampled per eval prompt; above 1, on the built-in task, eval/pass@k for k = 1,
    2, 4, ... up to n, unbiased (Chen et al. 2021): the target exactly"""
    log_completions_every: int = 0
    """every this many iterations, the batch's first prompts and completions (the student's or the dataset's) under
    train/completions in TensorBoard's text tab; 0: never (TRL: log_completions)"""


# ---------------------------------------------------------------------------------------------
# The math: pure functions. Logits are [B, T, V] at the completion tokens, token tensors [B, T] with `mask` 1 on
# completion tokens up to and including the first stop token. Checked by hand in tests/test_distill.py.
# ---------------------------------------------------------------------------------------------
def generalized_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    """The generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024, section 3) between the teacher's and
    the student's next-token distributions, one value per token, in float32, both at temperature T:

        π_S = softmax(z_S / T),  π_T = softmax(z_T / T),  M = β π_T + (1 − β) π_S
        JSD_β = β KL(π_T ‖ M) + (1 − β) KL(π_S ‖ M)

    and at the ends, as TRL 1.16's DistillationTrainer (where JSD_β itself goes to 0): β = 0 the forward
    KL(π_T ‖ π_S) (mode-covering: the student spreads over all the teacher's answers), β = 1 the reverse
    KL(π_S ‖ π_T) (mode-seeking: the student may drop answers but is punished for ones the teacher would not give).
    The gradient flows into the student's logits only."""
    log_s = torch.log_softmax(student_logits.float() / temperature, -1)
    log_t = torch.log_softmax(teacher_logits.float() / temperature, -1).detach()
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))  # log M, computed from the logs
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def sampled_token_loss(logprobs, teacher_logprobs):
    """Lu et al. 2025's on-policy distillation with the drawn token alone, per token: the reward of token x_t is
    −k_t, the reverse KL's one-sample estimate at its state, and the loss is REINFORCE's with no discount (each
    token is its own episode):

        k_t = log π_S(x_t) − log π_T(x_t),  x_t ~ π_S      E[k_t] = KL(π_S ‖ π_T) at that state
        L_t = stop_gradient(k_t) · log π_S(x_t)           E[∇L_t] = ∇ KL(π_S ‖ π_T)

    (the gradient of KL(π_S ‖ π_T) = Σ_x π_S(x) k(x) is Σ_x π_S ∇log π_S · k + Σ_x ∇π_S, and the last sum is 0). It
    needs the teacher's log-prob of the drawn token only, so a teacher behind a sampling server can score it."""
    return (logprobs - teacher_logprobs).detach() * logprobs


def success_demonstrations(passed, num_generations):
    """SDPO's privileged context from the student's own successes (Hübotter et al. 2026, arXiv 2601.20802, as TRL
    1.16's SuccessfulRolloutTeacherContextBuilder with dont_reprompt_on_self_success): for completion i of a group
    of G adjacent rows, the first other completion j ≠ i of the group that passes,

        d_i = min{ j ∈ group(i), j ≠ i : passed_j },   −1 where there is none (then o_i has no loss)

    so a success is taught by another success, never by itself."""
    demos = []
    for i in range(len(passed)):
        start = i - i % num_generations
        demos.append(next((j for j in range(start, start + num_generations) if j != i and passed[j]), -1))
    return demos


@torch.no_grad()
def ema_update(teacher, student, rate):
    """An exponentially averaged teacher (TRL's SDPO teacher_update_rate): θ_T ← (1 − τ) θ_T + τ θ_S for every
    parameter; τ = 0 leaves it (nothing computed), τ = 1 copies the student."""
    if rate == 0:
        return
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.lerp_(s.detach().to(t.dtype), rate)


def masked_mean(x, mask, num_tokens=None):
    """Σ x·mask / N, N the number of valid tokens (or `num_tokens`: those of the whole minibatch when it is
    split into micro-batches, so that the micro-batches' losses add up to the minibatch's)."""
    return (x * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)


def pass_at_k(n, c, k):
    """The unbiased estimator of pass@k from n samples of which c pass (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): the chance that k of the n, drawn without replacement, include a pass,

        pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k/i)

    (the product form is theirs, stable for large n). Whether any of the n passed, reported as pass@k for k < n,
    is biased high."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def check_args(args):
    """Every flag checked before any work: one line that says what to change."""
    settle_lengths(args, {"response_length": (12, None), "max_prompt_length": (64, 512)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    for name, least in {"num_iterations": 1, "batch_size": 1, "response_length": 1, "eval_every": 1,
                        "eval_size": 0, "eval_num_samples": 1, "log_completions_every": 0}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "temperature": "> 0"}.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    for name in ("beta", "lmbda"):  # `not 0 <= x <= 1` is also true of NaN
        if not 0 <= getattr(args, name) <= 1:
            sys.exit(f"error: --{name} {getattr(args, name)}: it must be between 0 and 1")
    if args.teacher_context not in ("answer", "success"):
        sys.exit(f"error: --teacher-context {args.teacher_context!r}: choose answer or success")
    if not args.self_distill and (args.teacher_context, args.teacher_prompt_template) != (Args.teacher_context,
                                                                                        Args.teacher_prompt_template):
        sys.exit("error: --teacher-context and --teacher-prompt-template shape the teacher's prompt under --self-distill "
                 "only; add it (a separate teacher reads the student's prompt)")
    if not 0 <= args.teacher_update_rate <= 1 or args.teacher_update_rate and not args.self_distill:
        sys.exit(f"error: --teacher-update-rate {args.teacher_update_rate}: in [0, 1], and it moves the teacher toward "
                 "the student only under --self-distill (a separate teacher stays frozen)")
    if args.num_generations < 1 or args.batch_size % args.num_generations:
        sys.exit(f"error: --batch-size {args.batch_size} does not split into groups of --num-generations "
                 f"{args.num_generations}")
    if args.self_distill and args.teacher_context == "success" and (args.num_generations < 2 or args.lmbda < 1):
        sys.exit("error: --teacher-context success takes the context from another completion of the same prompt: it "
                 f"needs --num-generations 2 or more and --lmbda 1 (got {args.num_generations}, {args.lmbda})")
    fields = set(re.findall(r"{\w*}", args.teacher_prompt_template))
    if args.self_distill and fields != {"{prompt}", "{privileged_context}"}:
        sys.exit(f"error: --teacher-prompt-template {args.teacher_prompt_template!r} needs {{prompt}} and "
                 "{privileged_context}")
    if args.sampled_token and (args.beta != 1 or args.lmbda != 1):
        sys.exit(f"error: --sampled-token estimates the reverse KL from the student's own samples: it needs --beta 1 "
                 f"and --lmbda 1 (got --beta {args.beta}, --lmbda {args.lmbda})")


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    B, G = args.batch_size, args.num_generations  # G completions of each prompt
    rng = random.Random(args.seed)  # the prompts drawn, and whose completions each batch trains on
    torch.manual_seed(args.seed)  # the sampling
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # Prompts (and completions, for the batches that are the dataset's), then the student and the teacher
    answer = args.self_distill or args.lmbda < 1  # a reference answer: the teacher's context, or the batches
    needs = [("prompt", "completion")] + [("prompt", "target")] * (args.lmbda == 1) if answer else [("prompt",)]
    train_rows, eval_rows = load_data(args, distillation_row, 50_000, needs, "needs a `prompt` column"
                                      + ", and a `completion` (or `target`) one for --lmbda < 1 or --self-distill"
                                      * answer)
    tokenizer, stop_ids, student, teacher, vocab = load_models(args, device)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, train_ids = tokenize_prompts(tokenizer, train_rows, args.max_prompt_length, "train")
    if len(train_ids) < B:
        sys.exit(f"error: {len(train_ids)} training prompts fit --max-prompt-length, fewer than the {B} of a batch; "
                 "lower --batch-size")
    eval_rows, eval_ids = tokenize_prompts(tokenizer, eval_rows, args.max_prompt_length, "eval")
    positions = min(p for p in (model_positions(student), model_positions(teacher), math.inf) if p is not None)
    settle_room(args, "response_length", 128, "TRL GKD's max_new_tokens", positions - max(len(ids) for ids in train_ids + eval_ids))
    if max(len(ids) for ids in train_ids + eval_ids) + args.response_length > positions:
        sys.exit(f"error: the longest prompt + --response-length {args.response_length} exceeds the models' "
                 f"{positions} positions; lower --max-prompt-length or --response-length")
    check_teacher_prompts(tokenizer, train_rows + eval_rows, positions, args)
    # the dataset's completions (GKD's supervised batches), each ending with its stop token, cut to the length
    dataset_ids = [tokenize_pair(tokenizer, row["prompt"], row["completion"], stop_ids)[1][: args.response_length]
                   for row in train_rows] if args.lmbda < 1 else []
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)  # the teacher is in no optimizer
    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"student {sum(p.numel() for p in student.parameters()):,} parameters, teacher "
          f"{sum(p.numel() for p in teacher.parameters()):,} (frozen); {len(train_ids):,} training prompts")

    # ---- the loop: an evaluation before any step, then completions, the teacher, a step, and log each iteration --
    models = (student, teacher, tokenizer, stop_ids)
    evaluate(models, vocab, eval_rows, eval_ids, amp, writer, 0, args)
    start_time = time.time()
    progress = Progress(args.num_iterations, "iterations", args.progress)
    for iteration in range(1, args.num_iterations + 1):
        lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr
        optimizer.param_groups[0]["lr"] = lr

        # ---- 1. completions: the student's own, with probability λ; else the dataset's ---------------------------
        chosen = [i for i in rng.sample(range(len(train_ids)), B // G) for _ in range(G)]  # G adjacent rows each
        on_policy = rng.random() < args.lmbda
        student.eval()
        with torch.no_grad(), amp():
            if on_policy:
                sequences, attention_mask, context_length, mask, _ = generate(
                    student, [train_ids[i] for i in chosen], tokenizer.pad_token_id, stop_ids, args.response_length,
                    args.temperature)
            else:
                sequences, attention_mask, context_length, mask = pad_completions(
                    [train_ids[i] for i in chosen], [dataset_ids[i] for i in chosen], tokenizer.pad_token_id, device)
        mask = mask.float()
        log_completions(writer, iteration, tokenizer, [train_rows[i] for i in chosen], sequences, context_length, args)

        # ---- 2. the teacher's next-token distribution at every completion token (frozen: no gradient) ------------
        with torch.no_grad(), amp():  # --self-distill: the teacher's prompt holds the privileged context
            seen, mask = teacher_view(tokenizer, [train_rows[i] for i in chosen], sequences, attention_mask,
                                      context_length, mask, args)  # and the tokens with a loss
            teacher_logits = completion_logits(teacher, *seen, vocab)

        # ---- 3. one step of the student toward the teacher on these tokens ---------------------------------------
        student.train()
        with amp():
            logits = completion_logits(student, sequences, attention_mask, context_length, vocab)
        if args.sampled_token:  # only the drawn token's log-probs: what a teacher behind a sampling server returns
            tokens = sequences[:, context_length:]
            logprobs = gather_logprobs(logits.float() / args.temperature, tokens)
            teacher_logprobs = gather_logprobs(teacher_logits.float() / args.temperature, tokens)
            per_token = sampled_token_loss(logprobs, teacher_logprobs)
        else:
            per_token = generalized_jsd(logits, teacher_logits, args.beta, args.temperature)
        loss = masked_mean(per_token, mask, mask.sum().clamp(min=1))  # 0 where no token has a loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), args.max_grad_norm)
        check_finite(iteration, loss=loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema_update(teacher, student, args.teacher_update_rate)  # --self-distill --teacher-update-rate τ

        # ---- 4. log: the batch's reverse KL over the whole vocabulary, whatever the loss -------------------------
        with torch.no_grad():
            reverse_kl = masked_mean(generalized_jsd(logits, teacher_logits, 1.0, args.temperature), mask,
                                     mask.sum().clamp(min=1)).item()
        logs = {"losses/loss": loss.item(), "objective/reverse_kl": reverse_kl,
                "objective/completion_length": mask.sum().item() / B, "train/grad_norm": grad_norm.item(),
                **({"objective/self_distill_fraction": mask.amax(1).mean().item()} if args.self_distill else {}),
                "charts/learning_rate": lr, "charts/episodes_per_second": iteration * B / (time.time() - start_time)}
        for tag, value in logs.items():
            writer.add_scalar(tag, value, iteration)
        if iteration % 20 == 0:
            print(f"iteration {iteration}: loss {loss.item():.4f}, reverse KL {reverse_kl:.4f} per token "
                  f"({'student' if on_policy else 'dataset'} completions), {time.time() - start_time:.0f} s")
        progress(iteration)
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            evaluate(models, vocab, eval_rows, eval_ids, amp, writer, iteration, args)

    save_model(student, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


@torch.no_grad()
def evaluate(models, vocab, eval_rows, eval_ids, amp, writer, iteration, args):
    """The student's completions of the eval prompts at --temperature (--eval-num-samples of each): their reverse KL
    to the teacher per token and, on the built-in task, their gold accuracy and score, sampled and greedy, as
    sft.py logs them (the teacher's too, before the first step: the accuracy distillation aims at), and with
    several samples pass@k."""
    student, teacher, tokenizer, stop_ids = models
    if not eval_ids:
        return
    student.eval()
    logs, samples, k = {}, None, args.eval_num_samples
    # the teacher too, before the first step (its weights are the student's under --self-distill: not again)
    for model, prefix in [(student, "")] + [(teacher, "teacher_")] * (iteration == 0 and not args.self_distill):
        for name, greedy in (("", False), ("_greedy", True)):
            n = k if model is student and not greedy else 1  # the student's samples of a prompt in adjacent rows
            with amp():
                sequences, attention_mask, context_length, mask, _ = generate(
                    model, [ids for ids in eval_ids for _ in range(n)], tokenizer.pad_token_id, stop_ids,
                    args.response_length, args.temperature, greedy)
            if model is student and not greedy:
                samples = tokenizer.batch_decode(sequences[::n, context_length:], skip_special_tokens=True)
                divergence = 0.0
                for i in range(0, len(sequences), args.batch_size):  # a batch at a time: the logits are [B, T, vocab]
                    with amp():
                        logits, teacher_logits = (completion_logits(m, sequences[i : i + args.batch_size],
                                                                    attention_mask[i : i + args.batch_size],
                                                                    context_length, vocab) for m in (student, teacher))
                    divergence += (generalized_jsd(logits, teacher_logits, 1.0, args.temperature)
                                   * mask[i : i + args.batch_size]).sum().item()
                logs["eval/reverse_kl"] = divergence / mask.sum().item()
            if args.dataset_name is None:  # the built-in task: exactly the target, and the gold score
                completions = tokenizer.batch_decode(sequences[:, context_length:], skip_special_tokens=True)
                targets = [row["target"] for row in eval_rows for _ in range(n)]
                logs[f"eval/{prefix}gold_accuracy{name}"] = (sum(c == t for c, t in zip(completions, targets))
                                                             / len(targets))
                logs[f"eval/{prefix}gold_score{name}"] = sum(map(gold_score, completions, targets)) / len(targets)
                if n > 1:
                    logs.update(pass_at_k_logs([c == t for c, t in zip(completions, targets)], n))
    for tag, value in logs.items():
        writer.add_scalar(tag, value, iteration)
    if iteration == 0:  # once: what the numbers are
        print(f"evaluation: {len(eval_ids):,} held-out prompts, {k} completion(s) each sampled at --temperature "
              f"{args.temperature} (_greedy: the argmax); eval/reverse_kl per token of the student's samples")
    print(f"iteration {iteration}: " + ", ".join(f"{tag} {value:.3f}" for tag, value in logs.items()))
    if args.dataset_name is not None and iteration == args.num_iterations:  # own data: what it learned
        print_samples([row["prompt"] for row in eval_rows], samples)
    writer.add_text("eval/samples", "\n".join(f"    {row['prompt']!r} {c!r}" for row, c in zip(eval_rows[:8], samples)),
                    iteration)
    student.train()


def pass_at_k_logs(passed, n):
    """{eval/pass@k: the mean over prompts of pass_at_k} for k = 1, 2, 4, ... up to n, from `passed` (passes), the
    n samples of each prompt in adjacent rows; {} with one sample (eval/gold_accuracy is pass@1) or no passes."""
    if passed is None or n == 1:
        return {}
    counts = torch.tensor(passed).view(-1, n).sum(1).tolist()
    return {f"eval/pass@{2 ** i}": sum(pass_at_k(n, c, 2 ** i) for c in counts) / len(counts)
            for i in range(n.bit_length()) if 2 ** i <= n}



def log_completions(writer, iteration, tokenizer, rows, sequences, context_length, args, n=8):
    """Every --log-completions-every iterations, the batch's first n prompts and completions (the student's or the
    dataset's) as text under train/completions, as eval/samples shows the eval prompts'."""
    if args.log_completions_every and iteration % args.log_completions_every == 0:
        completions = tokenizer.batch_decode(sequences[:n, context_length:], skip_special_tokens=True)
        writer.add_text("train/completions", "\n".join(f"    {row['prompt']!r} {c!r}" for row, c in zip(rows, completions)),
                        iteration)

def teacher_view(tokenizer, rows, sequences, attention_mask, context_length, mask, args):
    """What the teacher reads, and the tokens with a loss: ((sequences, attention_mask, context_length), mask).
    Without --self-distill, the student's own sequences and `mask`. With it, each row's prompt with its privileged
    context (teacher_prompt), left-padded, then the same completion tokens, so that the two models' logits line up
    token for token; under --teacher-context success the context is a sibling's successful completion
    (success_demonstrations), and a completion that has none keeps no token in the mask."""
    if not args.self_distill:
        return (sequences, attention_mask, context_length), mask
    answers = [reference_answer(row) for row in rows]
    contexts, keep = answers, [1.0] * len(rows)
    if args.teacher_context == "success":  # the student's own completions that are exactly the answer
        completions = tokenizer.batch_decode(sequences[:, context_length:], skip_special_tokens=True)
        demos = success_demonstrations([c.strip() == a.strip() for c, a in zip(completions, answers)],
                                       args.num_generations)
        contexts, keep = [completions[d] for d in demos], [float(d >= 0) for d in demos]
    prompt_ids = [encode_prompt(tokenizer, teacher_prompt(row["prompt"], context, args.teacher_prompt_template))
                  for row, context in zip(rows, contexts)]
    width, pad, device = max(map(len, prompt_ids)), tokenizer.pad_token_id, sequences.device
    prompts = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    seen = (torch.cat([prompts, sequences[:, context_length:]], 1),
            torch.cat([prompt_mask, attention_mask[:, context_length:]], 1), width)
    return seen, mask * torch.tensor(keep, device=device).unsqueeze(1)


def reference_answer(row):
    """A row's reference answer as text: its `completion` (the last message's content, if conversational), else its
    `target`."""
    answer = row["completion"] if "completion" in row else row["target"]
    return answer[-1]["content"] if isinstance(answer, list) else str(answer)


def teacher_prompt(prompt, context, template):
    """The teacher's prompt: --teacher-prompt-template with {prompt} and {privileged_context}; in a conversational
    prompt, the last user message's content is what the template wraps (TRL's)."""
    if not isinstance(prompt, list):
        return template.format(prompt=prompt, privileged_context=context)
    last = max(i for i, message in enumerate(prompt) if message["role"] == "user")
    wrapped = template.format(prompt=prompt[last]["content"], privileged_context=context)
    return prompt[:last] + [{**prompt[last], "content": wrapped}] + prompt[last + 1 :]


def check_teacher_prompts(tokenizer, rows, positions, args):
    """With --self-distill, one line before any work where the teacher's longest prompt (with the reference answer as
    its context) and --response-length exceed the model's positions."""
    if not args.self_distill or positions == math.inf:
        return
    longest = max(len(encode_prompt(tokenizer, teacher_prompt(row["prompt"], reference_answer(row),
                                                              args.teacher_prompt_template))) for row in rows)
    if longest + args.response_length > positions:
        sys.exit(f"error: the teacher's longest prompt with its context ({longest} tokens) + --response-length "
                 f"{args.response_length} exceeds the model's {positions} positions; lower --max-prompt-length or "
                 "shorten --teacher-prompt-template")


def completion_logits(model, sequences, attention_mask, context_length, vocab):
    """The logits of the next-token distribution at each completion token, [B, T, vocab], from one forward pass over
    prompt + completion; the first `vocab` columns, those the student and the teacher share."""
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    return model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_of(attention_mask),
                 use_cache=False).logits[:, context_length - 1 : -1, :vocab]


def pad_completions(prompt_ids, completion_ids, pad_token_id, device):
    """The dataset's completions laid out as `generate` lays out samples: (sequences, attention_mask,
    context_length, response_mask), prompts left-padded, completions right-padded."""
    width, length = max(map(len, prompt_ids)), max(map(len, completion_ids))
    rows = [[pad_token_id] * (width - len(p)) + p + c + [pad_token_id] * (length - len(c))
            for p, c in zip(prompt_ids, completion_ids)]
    masks = [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
             for p, c in zip(prompt_ids, completion_ids)]
    attention_mask = torch.tensor(masks, device=device)
    return torch.tensor(rows, device=device), attention_mask, width, attention_mask[:, width:]


def distillation_row(rng):
    """A row of the built-in task for distillation: grpo.py's prompt and target (the same random stream, so the same
    prompts as grpo.py's), and as the dataset's completion, the target: GKD's supervised batches are ground truth."""
    prompt, target = make_prompt(rng)
    return {"prompt": prompt, "target": target, "completion": target}


def load_models(args, device):
    """(tokenizer, stop_ids, student, teacher, vocab), on the device: the student in float32 (master weights), the
    teacher frozen, no dropout in either; vocab, the columns of logits both have. A teacher with another tokenizer
    stops with one line, before any work: the divergence compares the two models' distributions token for token."""
    tokenizer = load_tokenizer(args.model_name_or_path, "run `python sft.py --n-layer 1 --n-embd 64 --output-dir "
                                                        "models/sft_small` first or pass a path")
    stop_ids = stop_token_ids(tokenizer)
    teacher_path = args.model_name_or_path if args.self_distill else args.teacher_model_name_or_path
    teacher_tokenizer = load_tokenizer(teacher_path, "run `python sft.py && python grpo.py` first or pass a path")
    check_same_vocabulary(tokenizer, teacher_tokenizer, stop_ids, f"the teacher {teacher_path!r} "
                          f"has another tokenizer than the student {args.model_name_or_path!r}; distillation compares "
                          "their distributions token for token, so they must share one")
    student = load_no_dropout(args.model_name_or_path, "lm")
    teacher = load_no_dropout(teacher_path, "lm")
    prepare_models(tokenizer, stop_ids, [student, teacher], [teacher])
    # an output layer may have rows past the tokenizer's, padding that no token maps to (checkpoints of one family pad
    # to different sizes): the divergence compares the columns both have, every token of the shared tokenizer among them
    vocab = min(model.get_output_embeddings().weight.shape[0] for model in (student, teacher))
    return tokenizer, stop_ids, student.to(device), teacher.to(device), vocab


# =============================================================================================
# Plumbing: the built-in task, tokenization, data and model loading, forward passes and sampling,
# saving. Each definition below is pasted from the scripts that share it, one text in all of them
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


def tokenize_prompts(tokenizer, rows, max_prompt_length, split):
    """(rows, token ids of their prompts) of the rows whose `prompt` fits `max_prompt_length`; the others are
    dropped and counted."""
    encoded = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    kept = [i for i, ids in enumerate(encoded) if 0 < len(ids) <= max_prompt_length]
    if len(kept) < len(encoded):
        print(f"{split}: dropped {len(encoded) - len(kept):,} of {len(encoded):,} prompts longer than "
              f"--max-prompt-length {max_prompt_length} (or empty; the longest: {max(map(len, encoded)):,} tokens)")
    return [rows[i] for i in kept], [encoded[i] for i in kept]


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
