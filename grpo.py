"""GRPO: critic-free RL for language models, with the group of completions of a prompt as the baseline.

Shao et al. 2024, "DeepSeekMath", section 4.1 (Group Relative Policy Optimization). For each prompt q
sample G completions o_1..o_G from the current policy, reward each, and give every token of o_i the
advantage of o_i relative to its group, Â_i = (r_i − mean(r)) / std(r). No critic and, with a
verifiable reward (plain Python functions, --reward-fn), no reward model: the models in memory are the
policy and the frozen reference (and a reward model with --reward-model-path). The loss is PPO's clipped
surrogate plus a KL penalty to the reference (eq. 3):

    J = E[ (1/G) Σ_i (1/|o_i|) Σ_t  min( ρ_it Â_i, clip(ρ_it, 1 − ε, 1 + ε) Â_i ) − β D_KL[π_θ ‖ π_ref] ]

with ρ_it = π_θ(o_it | q, o_i,<t) / π_old(o_it | q, o_i,<t) and the KL estimated per token with k3 (eq. 4).
The variants of the first results table (docs/grpo.md) are flags: RLOO's leave-one-out baseline (--advantage
rloo), REINFORCE++'s normalization over the whole batch (--advantage reinforce_pp, reinforce_pp_baseline), no std
scaling (--scale-rewards none, Dr. GRPO), the loss over all tokens (--loss-type dapo) or over a constant
(--loss-type dr_grpo), a higher upper clip (--epsilon-high, DAPO), one ratio and one clip per completion
(--importance-sampling-level sequence, GSPO), a clipped importance weight that keeps every token's gradient
(--loss-type cispo, CISPO), no loss on completions cut at the length limit (--mask-truncated-completions, DAPO),
a reward penalty that grows near that limit (--soft-overlong-cache, DAPO), and groups of equal rewards replaced by
newly sampled ones (--dynamic-sampling, DAPO). The later variants (DPPO, GDPO, MaxRL, SAPO, LUSPO, VESPO, the
entropy controls, Clip-Cov and KL-Cov) and off-policy RL (--rollout-lag and its importance-sampling corrections)
are scale/grpo.py's alone.

    python sft.py && python grpo.py                      # built-in task: the gold score is the reward
    python grpo.py --reward-model-path models/reward_model   # the reward model of reward_model.py instead
    python grpo.py --advantage rloo                      # RLOO
    python grpo.py --dynamic-sampling                    # the recommended start (docs/grpo.md)
    python scale/grpo.py --rollout-lag 8 --vllm-importance-sampling-mode token_truncate  # off-policy, in scale/
    python grpo.py --model-name-or-path my-sft --dataset-name math.jsonl --reward-fn numeric_match --lr 1e-6

This is the one-device reference. scale/grpo.py computes the same thing and adds every other variant and what
larger runs need: torchrun (DDP, FSDP2), LoRA, gradient accumulation and checkpointing, sampling in chunks,
checkpoints that resume exactly, off-policy sampling.
"""

import collections
import ctypes
import datetime
import decimal
import functools
import importlib
import inspect
import json
import math
import multiprocessing
import os
import random
import re
import resource
import runpy
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
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
    """on a terminal, a line every ~10 s: the steps done, their rate, the time left and the batch's mean reward
    (--no-progress: none)"""
    model_name_or_path: Annotated[str, tyro.conf.arg(aliases=("--sft-model-path",))] = "models/sft"
    """hub id or local directory of the policy's start and the frozen reference (sft.py's output by default; TRL:
    model_name_or_path; --sft-model-path works too in this release, grpo.py's and rlhf_ppo.py's old name)"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a reward function, repeatable (the reward is the weighted sum): a built-in, gold (the built-in task's
    gold score: 1 − normalized edit distance to the `target`), exact_match, numeric_match or format (see below),
    or MODULE_OR_FILE:NAME of your own, fn(prompts, completions, **columns) -> list[float | None]. None given:
    gold on the built-in task"""
    reward_weights: tuple[float, ...] = ()
    """one weight per --reward-fn, in order, then one for the reward model if there is one; none given: all 1"""
    format_pattern: str | None = None
    """the regular expression of --reward-fn format, which the whole completion must match"""
    reward_timeout: float = 120.0
    """seconds one reward function may take on one batch (each worker's part of it); its completions then get None
    (not scored), counted in rewards/<name>_timeouts, and the run goes on"""
    reward_num_workers: int = 0
    """worker processes that call the reward functions, the batch split among them (forked: each holds the functions
    as loaded; a call past --reward-timeout is killed with its worker, which is replaced). 0: in the trainer, where
    the timeout stops Python code (SIGALRM), not a C call that never returns"""
    max_reward_failures: int = 3
    """a reward function that fails (times out or raises) on every completion of this many calls in a row stops the
    run, before it saves; one that fails on some is counted (rewards/<name>_errors) and the run goes on"""
    reward_model_path: str | None = None
    """a frozen reward model (reward_model.py's: models/reward_model) whose score is one more reward term;
    None: no reward model"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or .json/.jsonl/.parquet file with a `prompt` column (text or
    conversational); its other columns (a `target`, an `answer`) reach the reward functions by name; None:
    built-in task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to draw prompts from"""
    output_dir: str = "models/grpo"
    """where the trained policy is saved as a Hugging Face checkpoint (atomically)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    num_iterations: int = 120
    """rollout-then-update rounds, as in rlhf_ppo.py and CleanRL (TRL's max_steps counts optimizer steps instead)"""
    num_generations: int = 8
    """G: completions sampled per prompt; the group's rewards are each completion's baseline"""
    batch_size: int = 256
    """completions per rollout (batch_size / G prompts)"""
    mini_batch_size: int = 64
    """completions per gradient step"""
    ppo_epochs: int = 2
    """μ: passes over each rollout, as in rlhf_ppo.py (TRL: num_iterations; CleanRL: update_epochs)"""
    lr: float = 1e-4
    """AdamW learning rate (a pretrained model wants ~1e-6; CleanRL, TRL: learning_rate)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over the iterations"""
    response_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """new tokens sampled per completion (L_max of --loss-type dr_grpo) (default: 12 on the built-in task; on a
    dataset, TRL's max_completion_length 512, cut to what the model's positions leave)"""
    max_prompt_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """prompts longer than this many tokens are dropped (and counted), never cut (default: 64 on the built-in task,
    512 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast), the policy's weights
    and AdamW state float32. The reference is held and computed exactly as the policy (before the first update the
    KL is exactly 0)"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training divide the logits by it too"""
    advantage: str = "grpo"
    """grpo: (r − group mean) / group std; rloo: r − the mean of the other G − 1 rewards (Ahmadian et al. 2024);
    reinforce_pp: r normalized over the whole batch (REINFORCE++, Hu 2025); reinforce_pp_baseline: the
    group mean subtracted first (OpenRLHF: advantage_estimator reinforce / reinforce_baseline). MaxRL and GDPO's
    advantages are scale/grpo.py's"""
    scale_rewards: str = "group"
    """divide GRPO's advantages by the group's std (group) or not (none, Dr. GRPO, Liu et al. 2025) (TRL:
    scale_rewards; scale/grpo.py also has TRL's batch)"""
    loss_type: str = "grpo"
    """grpo: mean over each completion's tokens, then over completions; dapo: mean over all tokens of the rollout;
    dr_grpo: sum over tokens / (completions × --response-length); cispo: MiniMax-M1's clipped importance weight
    with every token's gradient kept, over all tokens of the batch (TRL: loss_type; dppo, sapo, luspo and vespo are
    scale/grpo.py's)"""
    importance_sampling_level: str = "token"
    """token: one ratio π_θ/π_old per token (GRPO, DAPO); sequence: GSPO's one ratio per completion, the geometric
    mean of its tokens' (Zheng et al. 2025), clipped per completion: its ε is about 1e-3 of the token-level one
    (the paper: --epsilon 3e-4 --epsilon-high 4e-4) (TRL: importance_sampling_level)"""
    epsilon: float = 0.2
    """ε of the clipped surrogate (the lower bound, 1 − ε; and the upper one unless --epsilon-high is set); CleanRL:
    clip_coef, rlhf_ppo.py: cliprange"""
    epsilon_high: float | None = None
    """upper clip bound 1 + ε_high (DAPO's clip-higher, e.g. 0.28); None: ε. With --loss-type cispo, the cap of
    the weight itself (TRL's meaning; e.g. 5.0)"""
    beta: float = 0.04
    """β of the k3 KL penalty to the reference (DeepSeekMath's 0.04); 0 drops the reference model (and eval/kl)"""
    missing_eos_penalty: float = -1.0
    """the reward of a completion with no stop token (EOS or end of turn) in its --response-length tokens, as in
    rlhf_ppo.py (an unfinished answer is not scored)"""
    mask_truncated_completions: bool = False
    """DAPO's overlong filtering: a completion cut at --response-length (no stop token) gets no loss and no KL
    penalty; its reward, --missing-eos-penalty, still enters its group's baseline (TRL: mask_truncated_completions)"""
    soft_overlong_cache: int = 0
    """DAPO's soft overlong punishment, L_cache tokens: a completion that stops within the last L_cache of the
    --response-length tokens gets a reward penalty growing linearly to −1 at the limit (soft_overlong_punishment);
    one cut at the limit keeps --missing-eos-penalty. 0: off (TRL: get_soft_overlong_punishment)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop each group whose G rewards are all equal (its advantages are 0, it teaches
    nothing) and sample more prompts until the batch is full of groups that differ (verl: filter_groups,
    OpenRLHF: dynamic_filtering). The objective/ logs describe the batch trained on; objective/prompts_sampled and
    objective/zero_std_fraction_sampled, what was sampled"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling, the most batches of prompts sampled in one iteration (the sampling cost of 1 to
    this many batches); when reached, the batch is filled with groups of equal rewards, and a line says so once"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    eval_every: int = 20
    """evaluate every this many iterations (and before the first and after the last)"""
    eval_size: int = 512
    """eval prompts, 0 for no evaluation: the built-in task's are those of sft.py, rlhf_ppo.py and dpo.py; a dataset's
    are its `test` split, or else prompts held out from the training ones"""
    eval_num_samples: int = 1
    """n: completions sampled per eval prompt; above 1, eval/pass@k for k = 1, 2, 4, ... up to n, unbiased (Chen et
    al. 2021), on the built-in task (the target exactly) and with reward functions (each one that applies scores 1)"""
    log_completions_every: int = 0
    """every this many iterations, a table of the rollout's first prompts, completions and reward terms under
    train/completions in TensorBoard's text tab; 0: never (TRL: log_completions)"""


# ---------------------------------------------------------------------------------------------
# The math: pure functions. Rewards and advantages are [B] with the G completions of a prompt in
# adjacent rows; token tensors are [B, response_length] with `mask` 1 on completion tokens up to and
# including the first stop token. Checked against hand-computed values in tests/test_grpo.py.
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """GRPO's advantage of completion i (Shao et al. 2024, section 4.1.2, outcome supervision), given to every
    one of its tokens; the group is the G completions of one prompt:

        Â_i = (r_i − mean(r)) / (std(r) + ε)      std over the group, with G − 1 in the denominator (as TRL)

    scale_rewards "none" (or False; Dr. GRPO, Liu et al. 2025): Â_i = r_i − mean(r). Dividing by the std gives
    groups whose rewards barely differ (prompts nearly always or nearly never solved) as much weight as the rest.
    A group of equal rewards gets Â = 0: it teaches nothing. An unscored completion (reward NaN) is left out of its
    group's mean and std, as in TRL 1.16; its own Â is NaN until compute_advantages makes it 0."""
    groups = rewards.view(-1, num_generations)
    advantages = groups - groups.nanmean(1, keepdim=True)
    if scale_rewards in ("group", True):  # the std of the scored rewards (torch.std's own where every one is scored)
        scored = (~groups.isnan()).sum(1, keepdim=True)
        std = torch.where(scored == num_generations, groups.std(1, keepdim=True),
                          (advantages.nan_to_num() ** 2).sum(1, keepdim=True).div(scored - 1).sqrt())
        advantages = advantages / (std + eps)
    return advantages.flatten()


def rloo_advantages(rewards, num_generations):
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024): each completion against the mean reward of the
    other G − 1 completions of its prompt, an unbiased baseline because it does not depend on o_i:

        Â_i = r_i − (1/(G − 1)) Σ_{j≠i} r_j  =  G/(G − 1) · (r_i − mean(r))

    the sum and G − 1 over the scored others where a completion is unscored (reward NaN)."""
    groups = rewards.view(-1, num_generations)
    baseline = (groups.nansum(1, keepdim=True) - groups) / ((~groups.isnan()).sum(1, keepdim=True) - 1)
    return (groups - baseline).flatten()


def reinforce_pp_advantages(rewards, num_generations, group_baseline, eps=1e-8):
    """REINFORCE++ (Hu 2025): no group statistics in the scale; the rewards are normalized over the whole batch,
    which keeps the estimate's scale steady where a group's own std would blow up the advantages of a group that
    barely differs:

        reinforce_pp            Â_i = (r_i − mean_B(r)) / std_B(r)
        reinforce_pp_baseline   Â_i = (r'_i − mean_B(r')) / std_B(r'),   r'_i = r_i − mean(r of its group)

    mean_B and std_B (population) over the B completions of the batch, the scored ones (reward not NaN). With the
    group baseline a group of equal rewards gets Â = 0; without it, its completions are compared with the batch."""
    x = rewards.view(-1, num_generations)
    x = (x - x.nanmean(1, keepdim=True) if group_baseline else x).flatten()
    scored = (~x.isnan()).sum()
    mean = x.nansum() / scored
    return (x - mean) * torch.rsqrt(((x - mean) ** 2).nansum() / scored + eps)


def compute_advantages(rewards, num_generations, advantage, scale_rewards):
    """Â_i of each completion by --advantage: grpo (group_advantages, with --scale-rewards none Dr. GRPO's), rloo
    (rloo_advantages), reinforce_pp and reinforce_pp_baseline (reinforce_pp_advantages, over the whole batch).
    An unscored completion (reward NaN: no reward function applies to it) gets Â = 0, as in TRL 1.16: it moves
    nothing, and the others' baselines leave it out."""
    if advantage == "rloo":
        advantages = rloo_advantages(rewards, num_generations)
    elif advantage.startswith("reinforce_pp"):
        advantages = reinforce_pp_advantages(rewards, num_generations, advantage == "reinforce_pp_baseline")
    else:
        advantages = group_advantages(rewards, num_generations, scale_rewards)
    return advantages.nan_to_num(0.0)


def informative_groups(rewards, num_generations):
    """DAPO's dynamic sampling filter (Yu et al. 2025, eq. 11, the constraint 0 < |{o_i | is_equivalent(a, o_i)}| < G):
    True for each group whose G rewards are not all equal. A group of equal rewards (every answer right, or every
    one wrong) has Â_i = 0 under grpo's and rloo's advantages and reinforce_pp_baseline's: it gives no gradient but
    still counts in the batch's normalizers and KL penalty, so the batch learns from fewer prompts. Unscored
    completions (NaN) do not count: a group needs two scored rewards that differ."""
    groups = rewards.view(-1, num_generations)
    return groups.nan_to_num(-math.inf).amax(1) > groups.nan_to_num(math.inf).amin(1)


def soft_overlong_punishment(lengths, max_length, cache):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward of a completion of |o| tokens,
    with L_max = `max_length` (--response-length) and L_cache = `cache`:

        R_length(o) = 0                                   |o| ≤ L_max − L_cache
                      ((L_max − L_cache) − |o|) / L_cache   L_max − L_cache < |o| ≤ L_max
                      −1                                  L_max < |o|

    so that length is discouraged before the limit cuts a completion (which then gets --missing-eos-penalty)."""
    return ((max_length - cache - lengths) / cache).clamp(-1.0, 0.0)


def kl_estimators(logprobs, ref_logprobs, mask):
    """Per-token estimators of KL[π_θ ‖ π_ref] on tokens sampled from π_θ (Schulman 2020, "Approximating
    KL divergence"), with log r = log π_ref − log π_θ:
        k1 = −log r = log π_θ − log π_ref          (unbiased, can be negative per token)
        k3 = (r − 1) − log r                        (unbiased, never negative)
    Returns (k1, k3), zero on padding."""
    log_r = ref_logprobs - logprobs
    return -log_r * mask, (log_r.exp() - 1 - log_r) * mask


def importance_ratio(logprobs, old_logprobs, mask, level):
    """The importance ratio of each token, [B, T]: level "token", ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t);
    level "sequence", GSPO's ratio of the whole completion (Zheng et al. 2025, eq. 7), the same at each of its tokens,

        s_i = (π_θ(o_i | q) / π_old(o_i | q))^(1/|o_i|) = exp( (1/|o_i|) Σ_t log ρ_it )

    so that one clip decides for the whole completion and its length does not scale the ratio."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    return torch.exp(log_ratio)


def clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high):
    """PPO's clipped surrogate per token, negated to be minimized, with DAPO's separate upper bound
    (clip-higher, Yu et al. 2025; epsilon_high = epsilon_low is PPO's):

        l_t = −min( ρ_t Â, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â ),   ρ_t from importance_ratio (GSPO: s_i)

    `advantages` has one value per completion, broadcast over its tokens."""
    advantages = advantages.unsqueeze(1)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages)


def cispo_loss(ratio, logprobs, advantages, epsilon_high):
    """CISPO (MiniMax-M1, 2025, eq. 4): clip the importance weight itself and stop its gradient, instead of
    cutting the gradient of the tokens whose ratio leaves the band, so that every token keeps its REINFORCE
    gradient Â ∇log π_θ, weighted by at most the cap:

        l_t = −sg( min(ρ_t, ε_high) ) Â log π_θ(o_t | q, o_<t)

    The cap is ε_high itself, as TRL 1.16's epsilon_high (it recommends 5.0); the paper writes it 1 + ε_high^IS,
    so its ε_high^IS = 4 is this 5.0. No lower bound, as in TRL's and verl's (the paper sets ε_low large). Summed
    over the tokens and divided by the rollout's tokens per step (aggregate_loss's cispo, the paper's 1/Σ|o_i|)."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * advantages.unsqueeze(1) * logprobs


def token_losses(ratio, logprobs, advantages, loss_type, epsilon_low, epsilon_high):
    """The per-token loss l_t by --loss-type: CISPO's (cispo_loss) for cispo, else the clipped surrogate
    (clipped_surrogate: grpo, dapo, dr_grpo). aggregate_loss then makes them one number."""
    if loss_type == "cispo":
        return cispo_loss(ratio, logprobs, advantages, epsilon_high)
    return clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)


def clipped_tokens(ratio, advantages, epsilon_low, epsilon_high, loss_type):
    """(low, high): where the clip is active on each side. The clipped surrogate cuts a token's gradient when ρ_t
    falls below 1 − ε_low with Â < 0 (low) or rises above 1 + ε_high with Â > 0 (high); out of the band on the
    other side, min() keeps the unclipped term. As TRL counts them. CISPO caps the weight above ε_high only."""
    if loss_type == "cispo":
        return torch.zeros_like(ratio, dtype=torch.bool), ratio > epsilon_high
    advantages = advantages.unsqueeze(1)
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def aggregate_loss(per_token_loss, mask, loss_type, num_sequences, num_tokens, max_completion_length):
    """The per-token losses l_it of a (micro-)batch as one number. The normalizers are those of the whole
    minibatch, so that the losses of its micro-batches (and ranks) add up to its loss:

        grpo      (1/B) Σ_i (1/|o_i|) Σ_t l_it     mean over each completion, then over completions (eq. 3)
        dapo      Σ_i Σ_t l_it / N                 every token of the rollout weighs the same (Yu et al. 2025)
        dr_grpo   Σ_i Σ_t l_it / (B · L_max)       a constant normalizer: no length bias (Liu et al. 2025)
        cispo     Σ_i Σ_t l_it / N                 as dapo, with CISPO's per-token loss (MiniMax-M1, 2025)

    B = `num_sequences` completions in the minibatch; N = `num_tokens`, the rollout's tokens ÷ its minibatches,
    as TRL 1.16 (a minibatch's own token count would weigh a token of a short minibatch more); L_max =
    `max_completion_length`. Under grpo a long wrong answer is penalized less per token than a short one."""
    summed = (per_token_loss * mask).sum(1)
    if loss_type == "grpo":
        return (summed / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type in ("dapo", "cispo"):
        return summed.sum() / num_tokens
    if loss_type == "dr_grpo":
        return summed.sum() / (num_sequences * max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}")


def pass_at_k(n, c, k):
    """The unbiased estimator of pass@k from n samples of which c pass (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): the chance that k of the n, drawn without replacement, include a pass,

        pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k/i)

    (the product form is theirs, stable for large n). Whether any of the n passed, reported as pass@k for k < n,
    is biased high."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ---------------------------------------------------------------------------------------------
# Rewards as plain Python functions, with TRL's signature: fn(prompts, completions, **columns) returns
# one float (or None: "does not apply to this completion") per completion. `columns` are the dataset's
# other columns of those rows, by name (`target`, `answer`, ...). A text prompt gets a text completion;
# a conversational prompt (a list of messages) gets [{"role": "assistant", "content": text}], as in TRL.
# Pick the built-in ones by name with --reward-fn, or write your own in a file (--reward-fn my.py:fn).
# The same text in grpo.py and rlhf_ppo.py (tests/test_copies.py checks it).
# ---------------------------------------------------------------------------------------------
def completion_text(completion):
    """The text of a completion: itself, or the content of a conversational one's (last) message."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def gold(prompts, completions, target, **columns):
    """The built-in sort task's gold score against the `target` column: 1 − normalized edit distance."""
    return [gold_score(completion_text(c), str(t)) for c, t in zip(completions, target)]


def exact_match(prompts, completions, target, **columns):
    """1.0 where the completion is the `target`, both stripped of surrounding whitespace; else 0.0."""
    return [float(completion_text(c).strip() == str(t).strip()) for c, t in zip(completions, target)]


def numeric_match(prompts, completions, target, **columns):
    """1.0 where the completion's answer_number equals the `target`'s (a number, or a GSM8K answer
    ending in `#### 72`); else 0.0, and None where the target holds no number (not a numeric question)."""
    expected = [answer_number(str(t)) for t in target]
    return [None if e is None else float(answer_number(completion_text(c)) == e) for c, e in zip(completions, expected)]


def format_match(prompts, completions, pattern, **columns):
    """1.0 where the whole completion matches the regular expression `pattern` (--format-pattern; `.` matches
    newlines too), e.g. r"<think>.*</think>\\s*<answer>.*</answer>"; else 0.0."""
    return [float(re.fullmatch(pattern, completion_text(c), re.DOTALL) is not None) for c in completions]


def code_execution(prompts, completions, tests, python=sys.executable, **columns):
    """open-r1's code reward, sandboxed: the completion's last fenced Python block (last_python_block), run with each
    assert of the row's `tests` column (a list of strings, as MBPP's test_list) after it, in a fresh sandboxed
    process (run_sandboxed: what it stops and what it does not are said there and in docs/grpo.md):

        r = (asserts that pass) / (asserts)       0 where there is no block or it does not run

    None where the row has no test (nothing to check). `python`: the interpreter of the sandbox (sandbox_python)."""
    rewards = []
    for completion, asserts in zip(completions, tests):
        program = last_python_block(completion_text(completion))
        passed = run_sandboxed(python, program, list(asserts)) if program is not None and asserts else 0
        rewards.append(passed / len(asserts) if asserts else None)
    return rewards


def last_python_block(text):
    """The code of the last fenced block of `text` (```python, ```py or a bare ```), or None where there is none."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else None


BUILTIN_REWARDS = {"gold": gold, "exact_match": exact_match, "numeric_match": numeric_match, "format": format_match,
                   "code_execution": code_execution}


def combine_rewards(per_function, weights):
    """The reward of each completion from K reward terms (the reward functions, then any reward model):

        r = Σ_k w_k r_k   over the terms that apply to it

    `per_function` is [B, K] with NaN where a function returned None. As TRL 1.16's GRPOTrainer does (nansum),
    a term that does not apply adds nothing, and a completion that no term applies to is unscored: NaN, which
    the advantages leave out of every baseline, with Â = 0 (compute_advantages)."""
    rewards = (per_function * torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)).nansum(1)
    return rewards.masked_fill(per_function.isnan().all(1), math.nan)


def check_args(args):
    """Every flag checked before any work: one line that says what to change."""
    check_reward_flags(args)
    settle_lengths(args, {"response_length": (12, None), "max_prompt_length": (64, 512)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation; a group needs 2 completions, its own baseline);
    # below it a run would crash deep inside (a modulo by zero, an empty batch) or train nothing
    for name, least in {"num_iterations": 1, "num_generations": 2, "mini_batch_size": 1, "max_sampling_rounds": 1,
                        "batch_size": 1, "ppo_epochs": 1, "response_length": 1, "eval_every": 1, "eval_size": 0,
                        "eval_num_samples": 1, "log_completions_every": 0}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "temperature": "> 0", "beta": ">= 0", "epsilon": "> 0",
                       "epsilon_high": "> 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    G = args.num_generations
    for flag, value, choices in (("--advantage", args.advantage, ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")),
                                 ("--loss-type", args.loss_type, ("grpo", "dapo", "dr_grpo", "cispo")),
                                 ("--importance-sampling-level", args.importance_sampling_level, ("token", "sequence")),
                                 ("--scale-rewards", args.scale_rewards, ("group", "none", True, False))):
        if value not in choices:  # the values of scale/grpo.py alone get a line that says where they are
            elsewhere = f" ({value} is scale/grpo.py's)" if value in ("maxrl", "batch", "dppo", "sapo", "luspo",
                                                                       "vespo") else ""
            sys.exit(f"error: {flag} {value!r}: choose one of {', '.join(map(str, choices))}{elsewhere}")
    if args.scale_rewards not in ("group", True) and args.advantage != "grpo":
        sys.exit(f"error: --scale-rewards {args.scale_rewards} changes --advantage grpo only; --advantage "
                 f"{args.advantage} has its own scale")
    if not 0 <= args.soft_overlong_cache < (args.response_length or math.inf):  # None: settled later
        length, top = ((f"--response-length {args.response_length}", args.response_length - 1) if args.response_length
                       else ("--response-length", "--response-length − 1"))  # None: not settled yet
        sys.exit(f"error: --soft-overlong-cache {args.soft_overlong_cache}: the last tokens before {length} where the "
                 f"penalty grows, from 0 (off) to {top}")
    if args.loss_type == "cispo" and args.importance_sampling_level == "sequence":
        sys.exit("error: --loss-type cispo weighs each token by its own ratio: use --importance-sampling-level token")
    if args.loss_type == "cispo" and args.epsilon_high is None:
        sys.exit("error: --loss-type cispo caps each token's weight at --epsilon-high itself (TRL's meaning): set it, "
                 "e.g. --epsilon-high 5.0 (TRL's recommendation, the paper's 1 + 4)")
    if args.batch_size % G:
        sys.exit(f"error: --batch-size {args.batch_size} completions do not split into groups of --num-generations {G}")
    if args.batch_size % args.mini_batch_size:
        sys.exit(f"error: --batch-size {args.batch_size} does not split into minibatches of {args.mini_batch_size}")
    if args.dataset_name is not None and not args.reward_fn and args.reward_model_path is None:
        sys.exit("error: a dataset needs a reward: --reward-fn (numeric_match, exact_match, format, or "
                 "my_rewards.py:fn) and/or --reward-model-path")
    terms = len(args.reward_fn) + (args.reward_model_path is not None) or 1  # none given: the gold score
    if args.reward_weights and len(args.reward_weights) != terms:
        sys.exit(f"error: --reward-weights has {len(args.reward_weights)} values for {terms} reward terms (one per "
                 "--reward-fn, in order, then one for the reward model)")
    if not all(map(math.isfinite, (args.missing_eos_penalty, *args.reward_weights))):  # rewards: either sign
        sys.exit(f"error: --missing-eos-penalty {args.missing_eos_penalty}, --reward-weights {list(args.reward_weights)}: "
                 "each must be a finite number")
    if args.reward_weights and not any(args.reward_weights) and not args.missing_eos_penalty:
        sys.exit(f"error: --reward-weights {' '.join(map(str, args.reward_weights))}: every term weighs 0, so every "
                 "reward is 0 and nothing is learned; give a term a weight")


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    # the reward functions: the built-in task's gold score unless others (or only a reward model) are given
    functions = load_reward_functions(args.reward_fn or (() if args.reward_model_path else ("gold",)),
                                      BUILTIN_REWARDS, args.format_pattern)
    guard = reward_guard(functions, args)  # --reward-num-workers: forked now, before any model is loaded
    weights = args.reward_weights or (1.0,) * (len(functions) + (args.reward_model_path is not None))
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    G, B = args.num_generations, args.batch_size
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the sampling
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # Prompts, and the dataset's other columns, which the reward functions receive by name; then the models
    train_rows, eval_rows = load_data(args, prompt_row, 50_000, [("prompt",)], "needs a `prompt` column")
    check_reward_signatures(functions, sorted(train_rows[0]) if train_rows else [])
    if "gold" in dict(functions) and any(str(row["target"]) == "" for row in train_rows + eval_rows):
        sys.exit(f"error: dataset {args.dataset_name!r} has an empty `target`; the gold score (an edit distance "
                 "relative to the target's length) needs one, or use --reward-fn exact_match")
    tokenizer, stop_ids, policy, ref, reward = load_models(args, device)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, train_ids = tokenize_prompts(tokenizer, train_rows, args.max_prompt_length, "train")
    if len(train_ids) < B // G:
        sys.exit(f"error: {len(train_ids)} training prompts fit --max-prompt-length, fewer than the {B // G} of a "
                 "batch; lower --batch-size")
    eval_rows, eval_ids = tokenize_prompts(tokenizer, eval_rows, args.max_prompt_length, "eval")
    positions, longest = model_positions(policy), max(len(ids) for ids in train_ids + eval_ids)
    settle_room(args, "response_length", 512, "TRL's max_completion_length", (positions or math.inf) - longest)
    if positions is not None and longest + args.response_length > positions:
        sys.exit(f"error: the longest prompt ({longest} tokens) + --response-length {args.response_length} exceeds the "
                 f"model's {positions} positions; lower --max-prompt-length or --response-length")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{1 + (ref is not None) + (reward is not None)} model(s) in memory: the policy"
          + (", the reference" if ref is not None else "") + (", the reward model" if reward is not None else ""))
    terms = RewardTerms(functions, weights, reward,
                        [name for name, _ in functions] + (["reward_model"] if reward is not None else []), guard)

    def rewards_of(rows, sequences, attention_mask, context_length, response_mask):
        """The reward of each completion, Σ_k w_k r_k over the reward terms (completion_rewards), and with
        --soft-overlong-cache DAPO's penalty for a completion that stops near the length limit (up to −1)."""
        rewards, table, completions, has_stop = completion_rewards(rows, sequences, attention_mask, context_length,
                                                                   response_mask, terms, tokenizer, stop_ids, args)
        if args.soft_overlong_cache:
            penalty = soft_overlong_punishment(response_mask.sum(1), args.response_length, args.soft_overlong_cache)
            rewards = torch.where(has_stop, rewards + penalty, rewards)
        return rewards, table, completions, has_stop

    def logprobs_of(model, sequences, attention_mask, context_length):
        """(log π(a_t | s_t), entropy) of every response token, a minibatch at a time: in a rollout these are
        exactly the update's forward passes, so the first ratio is exactly 1."""
        return forward_in_chunks(lambda s, a: policy_logprobs(model, s, a, context_length, args.temperature),
                                 args.mini_batch_size, sequences, attention_mask)

    # ---- the loop: an evaluation before any update, then sample, advantages, update and log each iteration -----
    models = (policy, ref, tokenizer, stop_ids, logprobs_of)
    evaluate(models, eval_rows, eval_ids, terms, rewards_of, amp, writer, 0, args)
    rng, said, start_time = random.Random(args.seed), set(), time.time()  # rng: the prompts drawn
    progress = Progress(args.num_iterations, "iterations", args.progress)
    for iteration in range(1, args.num_iterations + 1):
        lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr
        optimizer.param_groups[0]["lr"] = lr
        # ---- 1. sample groups: G completions of each prompt and their rewards ------------------------------
        policy.eval()
        with torch.no_grad(), amp():
            batch = sample_groups(policy, train_rows, train_ids, rng, rewards_of, tokenizer.pad_token_id, stop_ids,
                                  said, args)
            # ---- 2. advantages within each group (or over the batch), and the policy the update starts from ---
            advantages = compute_advantages(batch.rewards, G, args.advantage, args.scale_rewards)
            old = old_policy(policy, ref, batch, logprobs_of, args)

        # ---- 3. update: μ passes over the rollout in shuffled minibatches ------------------------------------
        policy.train()
        stats = {k: 0.0 for k in ("policy_loss", "kl_penalty", "clipped_low", "clipped_high",
                                  "policy_entropy")}  # summed over minibatches
        for epoch in range(args.ppo_epochs):
            # the first pass takes the rollout in order, so its first minibatch is exactly the rollout's first
            # chunk; later passes reshuffle (whole groups need not stay together: advantages are computed)
            order = torch.randperm(B, device=device) if epoch > 0 else torch.arange(B, device=device)
            for start in range(0, B, args.mini_batch_size):
                mb = order[start : start + args.mini_batch_size]
                with amp():
                    logprobs, entropy = policy_logprobs(policy, batch.sequences[mb], batch.attention_mask[mb],
                                                        batch.context_length, args.temperature)
                ratio = importance_ratio(logprobs, old.logprobs[mb], batch.mask[mb], args.importance_sampling_level)
                per_token = token_losses(ratio, logprobs, advantages[mb], args.loss_type, args.epsilon, epsilon_high)
                policy_loss = aggregate_loss(per_token, batch.loss_mask[mb], args.loss_type, args.mini_batch_size,
                                             batch.num_tokens, args.response_length)
                kl_penalty = kl_to_reference(logprobs, old.ref_logprobs, batch.loss_mask, mb, batch.num_tokens,
                                             args.response_length, args)
                (policy_loss + kl_penalty).backward()
                clipped = clipped_tokens(ratio, advantages[mb], args.epsilon, epsilon_high, args.loss_type)
                accumulate_grpo_stats(stats, policy_loss, kl_penalty, ratio, clipped, batch.mask[mb],
                                      (entropy.detach() * batch.loss_mask[mb]).sum(), epoch == start == 0)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                check_finite(iteration, loss=policy_loss + kl_penalty, grad_norm=grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        # ---- 4. log: statistics of the whole batch --------------------------------------------------------
        log_grpo_iteration(writer, iteration, batch, old, stats, terms, lr, start_time, args)
        progress(iteration, f"reward {float(batch.rewards.nanmean()):.3f}")
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            evaluate(models, eval_rows, eval_ids, terms, rewards_of, amp, writer, iteration, args)

    save_model(policy, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


@dataclass
class Groups:
    """A rollout of B completions, the G of each prompt in adjacent rows; token tensors are [B, response_length]."""
    sequences: torch.Tensor  # prompt and completion token ids, [B, context_length + response_length]
    attention_mask: torch.Tensor
    context_length: int  # the prompts' padded width: completions start at this column
    mask: torch.Tensor  # 1.0 on completion tokens up to and including the stop token
    rewards: torch.Tensor  # [B]
    table: torch.Tensor  # [B, K]: each reward term, NaN where it does not apply
    has_stop: torch.Tensor  # [B]: the completion ended with a stop token
    informative: torch.Tensor  # one per group sampled (every round): its rewards differ
    loss_mask: torch.Tensor  # the tokens the loss sees: with --mask-truncated-completions not an unfinished one's
    num_tokens: float  # dapo's and cispo's normalizer: the rollout's loss tokens per minibatch
    prompts: list  # each completion's prompt, as the dataset has it
    completions: list  # the completions' text


def sample_groups(policy, rows, prompt_ids, rng, rewards_of, pad_token_id, stop_ids, said, args):
    """B / G prompts drawn without replacement, G completions of each sampled at --temperature, and their rewards.
    With --dynamic-sampling (DAPO) more prompts are drawn, up to --max-sampling-rounds batches, until B / G groups
    whose rewards differ are found; the batch takes them first, in the order sampled, and groups of equal rewards
    only to fill up (said once: `said` holds the notes already printed)."""
    G, B, rounds = args.num_generations, args.batch_size, []
    while True:  # one batch of prompts; with --dynamic-sampling more, until enough groups differ
        chosen = rng.sample(range(len(prompt_ids)), B // G)
        ids = [prompt_ids[i] for i in chosen for _ in range(G)]  # each prompt G times, in adjacent rows
        sampled = generate(policy, ids, pad_token_id, stop_ids, args.response_length, args.temperature)
        rewards, table, texts, has_stop = rewards_of([rows[i] for i in chosen for _ in range(G)], *sampled[:3],
                                                     sampled[3].float())
        rounds.append({"sampled": sampled, "rewards": rewards, "table": table, "has_stop": has_stop, "texts": texts,
                       "prompts": [rows[i]["prompt"] for i in chosen for _ in range(G)]})
        informative = torch.cat([informative_groups(r["rewards"], G) for r in rounds])  # of every group sampled
        if not args.dynamic_sampling:
            break
        short = max(0, B // G - int(informative.sum()))  # groups that differ still missing from a batch
        if short == 0 or len(rounds) == args.max_sampling_rounds:
            break
    groups = torch.arange(B // G, device=informative.device)
    if args.dynamic_sampling:  # groups that differ first, in the order sampled; equal ones only to fill up
        groups = torch.argsort((~informative).int(), stable=True)[: B // G]
        if short and "short" not in said:
            print(f"dynamic sampling: after --max-sampling-rounds {args.max_sampling_rounds}, {short} group(s) short "
                  "of groups that differ: the batch is filled with equal ones, now and whenever this happens")
            said.add("short")
    idx = (groups[:, None] * G + torch.arange(G, device=groups.device)).flatten()  # their completions' rows
    sequences, attention_mask, context_length, mask, _ = join_samples([r["sampled"] for r in rounds], pad_token_id)
    mask, (rewards, table, has_stop) = mask[idx].float(), (torch.cat([r[k] for r in rounds])[idx]
                                                           for k in ("rewards", "table", "has_stop"))
    loss_mask = mask * has_stop.unsqueeze(1) if args.mask_truncated_completions else mask
    num_tokens = max(1.0, loss_mask.sum().item()) * args.mini_batch_size / B  # so that each token weighs the same
    texts, prompts = ([x for r in rounds for x in r[k]] for k in ("texts", "prompts"))
    return Groups(sequences[idx], attention_mask[idx], context_length, mask, rewards, table, has_stop, informative,
                  loss_mask, num_tokens, [prompts[i] for i in idx.tolist()], [texts[i] for i in idx.tolist()])


@dataclass
class RewardTerms:
    """What a completion's reward is made of: the reward functions (name, fn) and the reward model (or None),
    their weights, the name of each term (the reward model's "reward_model"), and the functions' RewardGuard."""
    functions: list
    weights: tuple
    reward: torch.nn.Module | None
    names: list
    guard: object  # the RewardGuard: how the reward functions are called, and their failures


def completion_rewards(rows, sequences, attention_mask, context_length, response_mask, terms, tokenizer, stop_ids,
                       args):
    """The reward of each completion, r = Σ_k w_k r_k over the reward functions and the reward model's score
    (combine_rewards), or --missing-eos-penalty for a completion with no stop token: an unfinished answer is not
    scored. Returns (rewards, the [B, K] table of the terms, completions as text, has_stop)."""
    prompts = [row["prompt"] for row in rows]
    # the text up to the stop token: the stop token and the padding after it are special tokens
    completions = tokenizer.batch_decode(sequences[:, context_length:], skip_special_tokens=True)
    as_passed = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c  # as TRL passes them
                 for p, c in zip(prompts, completions)]
    table = reward_terms(terms.functions, prompts, as_passed, reward_columns(rows), terms.guard).to(sequences.device)
    if terms.reward is not None:
        scores, _ = forward_in_chunks(
            lambda s, a, m: response_scores(terms.reward, s, a, m, stop_ids, args.missing_eos_penalty),
            args.mini_batch_size, sequences, attention_mask, response_mask)
        table = torch.cat([table, scores.float()[:, None]], 1)
    responses = sequences[:, context_length:]
    has_stop = (torch.isin(responses, torch.tensor(stop_ids, device=sequences.device)) & response_mask.bool()).any(1)
    rewards = combine_rewards(table, terms.weights)
    rewards = torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty))
    return rewards, table, completions, has_stop


@dataclass
class OldPolicy:
    """π_old on the rollout, the policy the update starts from; token tensors are [B, response_length]."""
    logprobs: torch.Tensor  # log π_old of each completion token
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None  # log π_ref; None when β = 0 (no reference)
    k1: torch.Tensor | None  # the KL estimators to π_ref (kl_estimators); None when β = 0
    k3: torch.Tensor | None


def old_policy(policy, ref, batch, logprobs_of, args):
    """π_old's and π_ref's log-probs of the rollout's tokens, and the KL between them (none when β = 0)."""
    logprobs, entropy = logprobs_of(policy, batch.sequences, batch.attention_mask, batch.context_length)
    ref_logprobs = k1 = k3 = None
    if args.beta > 0:
        ref_logprobs, _ = logprobs_of(ref, batch.sequences, batch.attention_mask, batch.context_length)
        k1, k3 = kl_estimators(logprobs, ref_logprobs, batch.mask)
    return OldPolicy(logprobs, entropy, ref_logprobs, k1, k3)


def kl_to_reference(logprobs, ref_logprobs, loss_mask, mb, num_tokens, max_completion_length, args):
    """The KL penalty of minibatch `mb`, β · D_KL[π_θ ‖ π_ref] with k3 per token, aggregated as the policy loss
    (TRL's, with the same normalizers: N = `num_tokens`, L_max = `max_completion_length`); 0 when β = 0."""
    if args.beta == 0:
        return torch.zeros((), device=logprobs.device)
    _, k3 = kl_estimators(logprobs, ref_logprobs[mb], loss_mask[mb])
    return args.beta * aggregate_loss(k3, loss_mask[mb], args.loss_type, args.mini_batch_size, num_tokens,
                                      max_completion_length)


@torch.no_grad()
def accumulate_grpo_stats(stats, policy_loss, kl_penalty, ratio, clipped, mask, entropy, first):
    """Adds a minibatch's losses, its clipped tokens (clipped_tokens' low and high) and `entropy` (summed over its
    loss tokens) to `stats`; at the first minibatch of an iteration, before any step, the ratio's largest distance
    from 1 (it must be exactly 0)."""
    stats["policy_loss"] += policy_loss.item()
    stats["kl_penalty"] += kl_penalty.item()
    stats["clipped_low"] += (clipped[0] * mask).sum().item()
    stats["clipped_high"] += (clipped[1] * mask).sum().item()
    stats["policy_entropy"] += float(entropy)
    if first:
        stats["first_ratio_max_error"] = (ratio - 1).abs().max()


def log_grpo_iteration(writer, iteration, batch, old, stats, terms, lr, start_time, args):
    """An iteration's statistics of the whole batch, to TensorBoard (docs/tags.md), and a line every 10 iterations;
    every --log-completions-every iterations, the rollout's first completions as text."""
    B, G, mask = args.batch_size, args.num_generations, batch.mask
    groups, tokens = batch.rewards.view(-1, G), mask.sum().item()
    num_minibatches = args.ppo_epochs * B // args.mini_batch_size
    logs = {  # the rewards' statistics over the scored completions (an unscored one's reward is NaN)
        "objective/reward": batch.rewards.nansum().item() / max(1, int((~batch.rewards.isnan()).sum())),
        "objective/reward_std": groups.std(1).nansum().item() / (B // G),
        "objective/zero_std_fraction": (groups.std(1) == 0).sum().item() / (B // G),
        "objective/completion_length": tokens / B, "objective/prompts_sampled": len(batch.informative),
        "objective/zero_std_fraction_sampled": (~batch.informative).sum().item() / len(batch.informative),
        "objective/entropy": (old.entropy * mask).sum().item() / B,
        "objective/stop_fraction": batch.has_stop.sum().item() / B,
        "losses/policy_loss": stats["policy_loss"] / num_minibatches,
        "policy/clipfrac": (stats["clipped_low"] + stats["clipped_high"]) / (args.ppo_epochs * tokens),
        "policy/clipfrac_low": stats["clipped_low"] / (args.ppo_epochs * tokens),
        "policy/clipfrac_high": stats["clipped_high"] / (args.ppo_epochs * tokens),
        "policy/first_ratio_max_error": stats["first_ratio_max_error"],
        "policy/entropy": stats["policy_entropy"] / (args.ppo_epochs * max(1.0, batch.loss_mask.sum().item())),
        "charts/learning_rate": lr, "charts/episodes_per_second": iteration * B / (time.time() - start_time),
    }
    if args.beta > 0:  # the KL to the reference
        logs.update({"objective/kl": old.k1.sum().item() / B, "objective/kl_k3": old.k3.sum().item() / B,
                     "losses/kl_penalty": stats["kl_penalty"] / num_minibatches})
    logs.update(term_means(batch.table, terms.names, "rewards/", "objective/score"))  # each reward term's mean
    logs.update(terms.guard.counts())  # the completions whose reward call failed since the last log
    for tag, value in logs.items():
        writer.add_scalar(tag, float(value), iteration)
    if args.log_completions_every and iteration % args.log_completions_every == 0:
        writer.add_text("train/completions", samples_markdown(batch.prompts, batch.completions, batch.rewards,
                                                              batch.table, terms.names), iteration)
    if iteration % 10 == 0:
        print(f"iteration {iteration}: reward {logs['objective/reward']:.3f} (std {logs['objective/reward_std']:.3f}), "
              f"kl {logs.get('objective/kl', 0.0):.3f}, {time.time() - start_time:.0f} s")


@torch.no_grad()
def evaluate(models, eval_rows, eval_ids, terms, rewards_of, amp, writer, iteration, args):
    """Completions of the eval prompts at --temperature (--eval-num-samples of each): their reward and each reward
    term, their KL to the reference (Σ_t log π_θ − log π_ref over a completion), on the built-in task their gold
    reward, and with several samples pass@k."""
    policy, ref, tokenizer, stop_ids, logprobs_of = models
    if not eval_ids:
        return
    k = args.eval_num_samples  # the samples of a prompt in adjacent rows
    eval_rows, eval_ids = [r for r in eval_rows for _ in range(k)], [ids for ids in eval_ids for _ in range(k)]
    policy.eval()
    with amp():
        sequences, attention_mask, context_length, response_mask, _ = generate(
            policy, eval_ids, tokenizer.pad_token_id, stop_ids, args.response_length, args.temperature)
        rewards, table, completions, _ = rewards_of(eval_rows, sequences, attention_mask, context_length, response_mask)
        n = len(eval_ids)  # the reward's mean over the scored completions (an unscored one's reward is NaN)
        logs = {"eval/reward": float(rewards.nansum()) / max(1, int((~rewards.isnan()).sum()))}
        if args.beta > 0:
            logprobs, _ = logprobs_of(policy, sequences, attention_mask, context_length)
            ref_logprobs, _ = logprobs_of(ref, sequences, attention_mask, context_length)
            logs["eval/kl"] = float(((logprobs - ref_logprobs) * response_mask).sum(1).sum()) / n
    if args.dataset_name is None:  # the built-in task: exactly the target, and the gold score
        logs["eval/gold_accuracy"] = sum(c == row["target"] for c, row in zip(completions, eval_rows)) / n
        logs["eval/gold_score"] = sum(gold_score(c, row["target"]) for c, row in zip(completions, eval_rows)) / n
    logs.update(term_means(table, terms.names, "eval/rewards/", "eval/score"))
    logs.update(pass_at_k_logs(passes(completions, eval_rows, table, terms.names, args.dataset_name is None), k))
    for tag, value in logs.items():
        writer.add_scalar(tag, value, iteration)
    if iteration == 0:  # once: what the numbers are
        print(f"evaluation: {n // k:,} held-out prompts, {k} completion(s) each sampled at --temperature {args.temperature}; "
              f"eval/reward is the training reward (--missing-eos-penalty {args.missing_eos_penalty} included)"
              + ", eval/gold_* the answer alone" * (args.dataset_name is None))
    print(f"iteration {iteration}: " + ", ".join(f"{tag} {value:.3f}" for tag, value in logs.items()))
    if args.dataset_name is not None and iteration == args.num_iterations:  # own data: what it learned
        print_samples([row["prompt"] for row in eval_rows[::k]], completions[::k])
    writer.add_text("eval/samples", samples_markdown([row["prompt"] for row in eval_rows[::k]], completions[::k],
                                                     rewards[::k], table[::k], terms.names), iteration)
    policy.train()


def pass_at_k_logs(passed, n):
    """{eval/pass@k: the mean over prompts of pass_at_k} for k = 1, 2, 4, ... up to n, from `passed` (passes), the
    n samples of each prompt in adjacent rows; {} with one sample (eval/gold_accuracy is pass@1) or no passes."""
    if passed is None or n == 1:
        return {}
    counts = torch.tensor(passed).view(-1, n).sum(1).tolist()
    return {f"eval/pass@{2 ** i}": sum(pass_at_k(n, c, 2 ** i) for c in counts) / len(counts)
            for i in range(n.bit_length()) if 2 ** i <= n}


def term_means(table, names, prefix, score_tag):
    """{tag: mean} of each reward term over the completions it applies to (where its value is not NaN), tagged
    prefix + its name, the reward model's `score_tag`; a term that applies to none is left out."""
    return {score_tag if name == "reward_model" else prefix + name:
            float(table[:, k].nan_to_num().sum()) / float((~table[:, k].isnan()).sum())
            for k, name in enumerate(names) if not table[:, k].isnan().all()}


def load_models(args, device):
    """(tokenizer, stop_ids, policy, reference or None, reward model or None), on the device. The policy in float32
    (master weights) whatever the checkpoint's dtype, the reference as the policy, so that before the first update
    the KL is exactly 0; dropout off in all. The reference only when β > 0, a reward model only with
    --reward-model-path."""
    tokenizer = load_tokenizer(args.model_name_or_path, "run `python sft.py` first or pass a path")
    stop_ids = stop_token_ids(tokenizer)
    if args.reward_model_path is not None:
        reward_tokenizer = load_tokenizer(args.reward_model_path, "run `python reward_model.py` first or pass a path")
        check_reward_model_data(args.reward_model_path, args.dataset_name)
        check_same_vocabulary(tokenizer, reward_tokenizer, stop_ids, f"the reward model {args.reward_model_path!r} has "
                              f"another tokenizer than {args.model_name_or_path!r}; train it from the SFT model")
    policy = load_no_dropout(args.model_name_or_path, "lm")
    ref = load_no_dropout(args.model_name_or_path, "lm") if args.beta > 0 else None
    reward = load_no_dropout(args.reward_model_path, "score") if args.reward_model_path is not None else None
    frozen = [model for model in (ref, reward) if model is not None]
    prepare_models(tokenizer, stop_ids, [policy] + frozen, frozen)
    return tokenizer, stop_ids, *(model.to(device) if model is not None else None for model in (policy, ref, reward))


# =============================================================================================
# Plumbing: the built-in task, tokenization, data and model loading, reward functions, forward passes and
# sampling, saving. Each definition below is pasted from the scripts that share it, one text in all of them
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


def check_reward_model_data(path, dataset_name):
    """One line before any work where the reward model at `path` was trained on the built-in task (its
    training_args.json says so) but would score the completions of a dataset, text it has never seen."""
    if dataset_name is not None and reward_model_data(path) is None:
        sys.exit(f"error: the reward model {path!r} was trained on the built-in task, not for {dataset_name!r}; pass "
                 "--reward-model-path of one trained for your data (reward_model.py --dataset-name ...), or None and "
                 "--reward-fn")


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
# Reward functions (--reward-fn): loading, checking and calling them, and the answer parsing of numeric_match
# (GSM8K's `#### 72`, \boxed{}). The functions themselves, and how their values add up, are above the banner.
# ---------------------------------------------------------------------------------------------
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 1,234.5 with thousands separators, or 1234.5


def last_boxed(text):
    """What the last \\boxed{...} of `text` contains, braces inside it matched (\\boxed{\\frac{1}{2}}), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None  # never closed


def answer_number(text):
    """The number a text gives as its answer, or None: the first number after the last `####` (GSM8K's
    answers), else the number in the last \\boxed{} (None unless it holds exactly one), else the last number
    of the text. A Decimal: `,` thousands separators and trailing zeros (72.0, 72.50) do not change it."""
    if "####" in text:
        numbers = NUMBER.findall(text.rsplit("####", 1)[1])[:1]
    elif last_boxed(text) is not None:
        numbers = NUMBER.findall(last_boxed(text))
        numbers = numbers if len(numbers) == 1 else []
    else:
        numbers = NUMBER.findall(text)[-1:]
    return decimal.Decimal(numbers[-1].replace(",", "")) if numbers else None


def load_reward_functions(specs, builtins, format_pattern):
    """[(name, fn)] for --reward-fn: a built-in's name (a key of `builtins`), or MODULE_OR_FILE:NAME, a function
    in a .py file (by path) or in an importable module (the working directory is on the path). What cannot be
    found or imported is one line, before any model is loaded."""
    functions = []
    for spec in specs:
        source, _, name = spec.rpartition(":")
        if spec in builtins:
            name, fn = spec, builtins[spec]
            if spec == "format":  # the built-in format reward: the pattern is its one setting
                try:
                    re.compile(format_pattern or "")
                except re.error as e:
                    sys.exit(f"error: --format-pattern {format_pattern!r} is not a regular expression: {e}")
                if not format_pattern:
                    sys.exit("error: --reward-fn format needs --format-pattern REGEX, which the whole completion "
                             "must match")
                fn = functools.partial(fn, pattern=format_pattern)
            if spec == "code_execution":  # its sandbox tried once and its isolation said, before any model is loaded
                fn = functools.partial(fn, python=sandbox_python())
        elif not source or not name:
            sys.exit(f"error: --reward-fn {spec!r}: name a built-in ({', '.join(builtins)}) or a function of "
                     "yours as MODULE_OR_FILE:NAME (e.g. my_rewards.py:correctness)")
        else:
            if not source.endswith(".py") and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # a module of the directory the run starts in
            if source.endswith(".py") and not os.path.isfile(source):
                sys.exit(f"error: --reward-fn {spec!r}: the file {source!r} does not exist")
            try:  # a file runs as a module of its own (its `if __name__ == "__main__":` block does not)
                namespace = runpy.run_path(source) if source.endswith(".py") else vars(importlib.import_module(source))
            except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
                sys.exit(f"error: --reward-fn {spec!r}: importing {source!r} failed: {type(e).__name__}: {first_line(e)}")
            fn = namespace.get(name)
            if not callable(fn):
                sys.exit(f"error: --reward-fn {spec!r}: {source!r} has no function {name!r}")
        if name in [n for n, _ in functions]:
            sys.exit(f"error: --reward-fn {name!r} is given twice; each reward function once, weighted by "
                     "--reward-weights")
        functions.append((name, fn))
    return functions


def check_reward_signatures(functions, columns):
    """Each reward function is called as fn(prompts=..., completions=..., <column>=... for each of the dataset's
    `columns` but the prompt), as TRL calls it: one that cannot take those keywords is one line, before any model
    is loaded. A function that needs a column the dataset lacks (the built-ins need `target`) is caught here."""
    keywords = {"prompts": [], "completions": [], **{c: [] for c in columns if c != "prompt"}}
    for name, fn in functions:
        try:
            inspect.signature(fn).bind(**keywords)
        except TypeError as e:
            needed = [p.name for p in inspect.signature(fn).parameters.values() if p.name not in keywords
                      and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if getattr(fn, "func", fn) is BUILTIN_REWARDS.get(name) and needed:  # a built-in: the data lacks a column
                sys.exit(f"error: the built-in reward {name!r} compares each completion with the dataset's "
                         f"{', '.join(f'`{c}`' for c in needed)} column (what it checks against), which it lacks (its columns: "
                         f"{sorted(columns)}); add it, or pass a reward function of yours (--reward-fn FILE.py:NAME)")
            sys.exit(f"error: reward function {name!r} cannot be called as {name}({', '.join(keywords)}): {e}; write "
                     f"it as def {name}(prompts, completions, **columns) (the dataset's columns: {sorted(columns)})")


def reward_columns(rows):
    """What reward functions receive of these rows as **columns: every column of the data but `prompt`, by name."""
    return {name: [row[name] for row in rows] for name in rows[0] if name != "prompt"} if rows else {}


def reward_terms(functions, prompts, completions, columns, guard):
    """[B, K] float32: reward function k on completion i (call_reward: timed, and in the guard's workers where it has
    any), NaN where it returned None ("does not apply") or its call failed (counted)."""
    table = torch.full((len(completions), len(functions)), float("nan"))
    for k, (name, fn) in enumerate(functions):
        values = call_reward(guard, name, fn, prompts, completions, columns)
        table[:, k] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    return table


def check_reward_flags(args):
    """One line before any work for --reward-timeout, --reward-num-workers or --max-reward-failures out of range."""
    for flag, value, rule, ok in (
            ("--reward-timeout", args.reward_timeout, "a finite number of seconds > 0",
             math.isfinite(args.reward_timeout) and args.reward_timeout > 0),
            ("--reward-num-workers", args.reward_num_workers, "0 or more", args.reward_num_workers >= 0),
            ("--max-reward-failures", args.max_reward_failures, "1 or more", args.max_reward_failures >= 1)):
        if not ok:
            sys.exit(f"error: {flag} {value}: it must be {rule}")


class RewardTimeout(BaseException):
    """Raised in the trainer at --reward-timeout by SIGALRM (a BaseException: the function's `except Exception` does
    not swallow it)."""


@dataclass
class RewardGuard:
    """How the reward functions are called (--reward-timeout, --reward-num-workers, --max-reward-failures) and what
    became of the calls: per function, the completions whose call timed out or raised since the last log, the calls
    in a row that failed on every completion, and each function's first failure (said once)."""
    names: list  # the reward functions'
    timeout: float
    max_failures: int
    workers: list  # Worker processes that hold the functions; [] = called in the trainer
    timeouts: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    in_a_row: collections.Counter = field(default_factory=collections.Counter)
    first: dict = field(default_factory=dict)

    def counts(self):
        """{rewards/<name>_timeouts, rewards/<name>_errors: completions since the last log} of each function, reset."""
        logs = {f"rewards/{name}_{kind}": float(counter[name]) for name in self.names
                for kind, counter in (("timeouts", self.timeouts), ("errors", self.errors))}
        self.timeouts.clear()
        self.errors.clear()
        return logs


def reward_guard(functions, args):
    """The RewardGuard of a run: with --reward-num-workers N, N worker processes forked now, each holding every
    reward function; 0: the functions are called in the trainer."""
    workers = [Worker(dict(functions)) for _ in range(args.reward_num_workers)]
    return RewardGuard([name for name, _ in functions], args.reward_timeout, args.max_reward_failures, workers)


def call_reward(guard, name, fn, prompts, completions, columns):
    """One reward function's values on a batch, guarded: the batch split among the guard's workers (in the trainer
    where it has none), each part a call that must end within --reward-timeout. A part that times out, raises, or
    returns anything but one finite number or None per completion gets None ("does not apply"), counted in
    rewards/<name>_timeouts or _errors, its function's first failure said once; the run goes on. A function that fails
    on every completion of --max-reward-failures calls in a row stops the run with one line, before it saves."""
    n, parts = len(completions), max(1, min(len(guard.workers), len(completions)))
    bounds = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
    jobs = [{"prompts": prompts[a:b], "completions": completions[a:b], **{c: v[a:b] for c, v in columns.items()}}
            for a, b in bounds]
    if guard.workers:
        deadline = time.monotonic() + guard.timeout
        for worker, job in zip(guard.workers, jobs):
            worker.send(name, job)
        outcomes = [worker.result(deadline) for worker, _ in zip(guard.workers, jobs)]
    else:
        outcomes = [call_in_process(fn, jobs[0], guard.timeout)]
    values, failures, first = [], 0, None
    for (a, b), outcome in zip(bounds, outcomes):
        status, result = reward_outcome(*outcome, b - a)
        if status == "ok":
            values += result
            continue
        values, failures = values + [None] * (b - a), failures + b - a
        (guard.timeouts if status == "timeout" else guard.errors)[name] += b - a
        first = first or (f"timed out after --reward-timeout {guard.timeout:g} s" if status == "timeout" else result,
                          "timeouts" if status == "timeout" else "errors")
    if first and name not in guard.first:
        guard.first[name] = first[0]
        print(f"note: reward function {name!r} {first[0]} on {failures} of {n} completion(s): None (not scored), "
              f"counted in rewards/{name}_{first[1]}; the run goes on (said once)")
    guard.in_a_row[name] = guard.in_a_row[name] + 1 if n and failures == n else 0
    if guard.in_a_row[name] >= guard.max_failures:
        sys.exit(f"error: reward function {name!r} failed on every completion of {guard.in_a_row[name]} calls in a row "
                 f"(--max-reward-failures {guard.max_failures}; its first failure: {guard.first[name]}); stopped, "
                 "nothing saved")
    return values


def reward_outcome(status, result, n):
    """(status, the values or the failure's text) of one call's outcome on n completions: what it raised as one line,
    and an error where it returned anything but n values, each a finite number or None."""
    if status == "raised":
        return "error", f"raised {result[0]}: {(result[1].splitlines() or [result[0]])[0]}"
    if status != "ok":
        return status, result
    values = (result.tolist() if hasattr(result, "tolist") else list(result)  # a numpy array, a generator
              if hasattr(result, "__iter__") and not isinstance(result, (str, bytes, dict)) else result)
    if not isinstance(values, list):
        return "error", f"returned {values!r}, not a list of one value per completion"
    if len(values) != n:
        return "error", f"returned {len(values)} values for {n} completions"
    bad = [v for v in values if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))]
    return ("error", f"returned {bad[0]!r} (a finite number or None is needed)") if bad else ("ok", values)


def call_in_process(fn, job, timeout):
    """("ok", fn(**job)), or ("timeout", None) after `timeout` seconds (SIGALRM, in the main thread: it stops Python
    code and sleeps, not a C call that never returns; --reward-num-workers does), or ("raised", (its type, message))."""
    def expire(signum, frame):
        raise RewardTimeout

    alarm = threading.current_thread() is threading.main_thread()
    if alarm:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "ok", fn(**job)
    except RewardTimeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is counted, and the run goes on
        return "raised", (type(e).__name__, str(e))
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


class Worker:
    """A worker process forked from the trainer, so that it holds the trainer's functions (`table`, name: fn) as they
    were loaded, in a process group of its own and killed with the trainer. It runs one call at a time: send(name,
    kwargs), then result(deadline): ("ok", the value), ("raised", (the exception's type, message)), ("error", what
    else went wrong) or ("timeout", None). At the deadline, or where it died, the worker is killed with its group
    (whatever the call started) and replaced by a fresh fork.
    `memory`: bytes of address space a call may add to what the worker forked with (RLIMIT_AS), None: no bound."""

    def __init__(self, table, memory=None):
        self.table, self.memory = table, memory
        self.start()

    def start(self):
        context = multiprocessing.get_context("fork")  # the functions are inherited, not pickled (as DataLoader's)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_loop, args=(child, self.table, self.memory), daemon=True)
        self.process.start()
        child.close()

    def send(self, name, kwargs):
        self.conn.send((name, kwargs))

    def result(self, deadline):
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            self.restart()
            return "timeout", None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            code = self.process.exitcode
            self.restart()
            return "error", f"killed its worker process (exit code {code})"

    def restart(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.join()
        self.conn.close()
        self.start()


def worker_loop(conn, table, memory):
    """A Worker's process: in a session of its own (killed whole), SIGKILLed if the trainer dies (PR_SET_PDEATHSIG),
    with `memory` more bytes of address space than it forked with, it runs each call it is sent and sends back the
    outcome: ("raised", (type, message)) for whatever the call raises, ("error", ...) for a value that cannot be sent."""
    os.setsid()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux, as resource limits and /proc here)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):  # not the trainer's handlers (scale/'s SIGTERM)
        signal.signal(signum, signal.SIG_DFL)
    if memory is not None:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + memory, size + memory))
    while True:
        try:
            name, kwargs = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            outcome = "ok", table[name](**kwargs)
        except BaseException as e:  # noqa: BLE001  the user's code: whatever it raises is the caller's to read
            outcome = "raised", (type(e).__name__, str(e))
        try:
            conn.send(outcome)
        except Exception as e:  # noqa: BLE001  a value pickle cannot send
            conn.send(("error", f"returned a value that cannot be sent back ({type(e).__name__}: {first_line(e)})"))


# ---- the sandbox of code_execution ---------------------------------------------------------
SANDBOX_LIMITS = {"RLIMIT_CPU": 5, "RLIMIT_AS": 1 << 30, "RLIMIT_FSIZE": 16 << 20, "RLIMIT_NPROC": 16,
                  "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}  # CPU s, address space, file size, processes, files, core
SANDBOX_WALL_SECONDS = 10  # the whole program and its asserts; past it the sandbox is killed
NOBODY = 65534  # the unprivileged user the model's code runs as where the trainer is root


@functools.cache
def sandbox_python():
    """The interpreter code_execution's sandbox runs: the trainer's, or where the trainer is root and its Python is
    one nobody cannot read (a Python under /root), the system's python3. Tried once on a program that imports the
    standard library; the sandbox's isolation is said in one line, and no Python that runs is one line."""
    candidates = [sys.executable] + (["/usr/bin/python3", "/usr/local/bin/python3"] if os.getuid() == 0 else [])
    for python in dict.fromkeys(candidates):
        setup = []
        if os.path.exists(python) and run_sandboxed(python, "import collections, math, re", ["pass"], setup) == 1:
            uid, isolated = setup[0]
            print(f"code_execution: the model's code runs in {python} as uid {uid}, "
                  + ("in network and PID namespaces of its own" if isolated == "True" else
                     "WITH the network (no namespace could be made: unshare needs root or user namespaces)")
                  + f", limits {SANDBOX_LIMITS} and {SANDBOX_WALL_SECONDS} s (docs/grpo.md)")
            return python
    sys.exit(f"error: --reward-fn code_execution: no Python among {candidates} runs in the sandbox (as uid {NOBODY} "
             "where the trainer is root, who cannot read a Python under /root)")


def run_sandboxed(python, program, asserts, setup=None):
    """How many of `asserts` pass after `program`, run in a sandbox: a fresh `python -I -S` (no site-packages, no
    PYTHON* variables) in its own session and an empty temporary directory, with no environment variables, its
    output discarded, and sandbox_main's isolation: SANDBOX_LIMITS (CPU time, address space, file size, processes,
    open files), uid nobody where the trainer is root, network and PID namespaces where the OS allows (no network;
    every process it starts dies with it); killed with its session after SANDBOX_WALL_SECONDS. The count comes back
    on a pipe of its own, each line tagged with a secret, so text the program prints is not read. It does NOT stop:
    reading what every user may read (world-readable files), writing files of up to 16 MiB where every user may
    (/tmp, /dev/shm; its own directory is removed), or a program written against this harness forging its count
    (it runs in the process that counts). `setup`, a list: gets (uid, isolated) of the run."""
    nonce, (read, write) = secrets.token_hex(16), os.pipe()
    job = json.dumps({"nonce": nonce, "program": program, "asserts": asserts, "limits": SANDBOX_LIMITS,
                      "nobody": NOBODY}).encode()
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as directory:
        if os.getuid() == 0:
            os.chown(directory, NOBODY, NOBODY)
        try:
            process = subprocess.Popen(
                [python, "-I", "-S", "-c", inspect.getsource(sandbox_main) + "\nsandbox_main()\n", str(write)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=directory, env={},
                start_new_session=True, pass_fds=(write,))
        finally:
            os.close(write)
        try:
            process.stdin.write(job)
            process.stdin.close()
            process.wait(SANDBOX_WALL_SECONDS)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        finally:  # --reward-timeout's interrupt too: nothing is left running
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the session: whatever it started and left behind
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
            output = read_all(read)
    lines = [line.split()[1:] for line in output.decode(errors="replace").splitlines() if line.startswith(nonce + " ")]
    if setup is not None:
        setup += [words[1:] for words in lines if words[:1] == ["setup"]]
    return len({words[1] for words in lines if words[:1] == ["pass"] and len(words) == 2})


def read_all(fd):
    """What a pipe holds now, without waiting for more, and the pipe closed."""
    os.set_blocking(fd, False)
    output = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            output += chunk
    except BlockingIOError:
        pass
    os.close(fd)
    return output


def sandbox_main():
    """The sandbox itself, run by run_sandboxed as the source of a fresh interpreter (it imports nothing of the
    trainer): it reads its job, makes network and PID namespaces where it may (unshare), forks the program's process
    (PID 1 of the new namespace: when it ends, every process it started is killed), which sets the limits, becomes
    nobody where it is root, dies with its parent, then runs the program and each assert, reporting `setup` and
    each `pass` on the pipe."""
    import ctypes
    import json
    import os
    import resource
    import signal
    import sys

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with the process that started it (a killed worker)
    job, out = json.loads(sys.stdin.buffer.read()), int(sys.argv[1])
    flags = 0x40000000 | 0x20000000  # CLONE_NEWNET | CLONE_NEWPID
    isolated = libc.unshare(flags) == 0 or os.getuid() != 0 and libc.unshare(flags | 0x10000000) == 0  # | NEWUSER
    if os.fork():
        os.wait()
        os._exit(0)
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(job["nobody"])
        os.setuid(job["nobody"])
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with the process that waits for it
    nonce, asserts, program = job.pop("nonce"), job.pop("asserts"), job.pop("program")
    os.write(out, f"{nonce} setup {os.getuid()} {isolated}\n".encode())
    scope = {"__name__": "__main__"}
    try:
        exec(compile(program, "<completion>", "exec"), scope)
    except BaseException:  # noqa: BLE001  it does not run (sys.exit included): no assert is tried
        os._exit(1)
    for i, test in enumerate(asserts):
        try:
            exec(compile(test, "<test>", "exec"), scope)
            os.write(out, f"{nonce} pass {i}\n".encode())
        except BaseException:  # noqa: BLE001, S110  a failed assert, or anything else it raises
            pass
    os._exit(0)


def samples_markdown(prompts, completions, rewards, table, names, n=8):
    """The first n eval samples as a Markdown table for TensorBoard's text tab: prompt, completion, reward and
    each reward term (blank where it did not apply)."""
    # one line per cell: escapes for newlines and control characters (json's), and for the column separator
    def cell(x):
        return json.dumps(x[-1]["content"] if isinstance(x, list) else x, ensure_ascii=False)[1:-1].replace("|", "\\|")

    lines = ["| prompt | completion | reward | " + " | ".join(names) + " |", "|-" * (3 + len(names)) + "|"]
    for i in range(min(n, len(completions))):
        terms = ["" if math.isnan(v) else f"{v:.3f}" for v in table[i].tolist()]
        lines.append(f"| {cell(prompts[i])} | {cell(completions[i])} | {float(rewards[i]):.3f} | "
                     + " | ".join(terms) + " |")
    return "\n".join(lines)


def passes(completions, rows, table, names, builtin):
    """Whether each completion passes, for pass@k: on the built-in task it is exactly the target; else every reward
    function that applies to it scores it 1 or more (exact_match, numeric_match, format: a pass), and one does.
    None where there is no reward function (a reward model's score has no pass)."""
    if builtin:
        return [c == row["target"] for c, row in zip(completions, rows)]
    functions = table[:, [k for k, name in enumerate(names) if name != "reward_model"]]
    if functions.shape[1] == 0:
        return None
    return ((functions.nan_to_num(math.inf) >= 1).all(1) & ~functions.isnan().all(1)).tolist()

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


def policy_logprobs(model, sequences, attention_mask, context_length, temperature):
    """(log π(a_t | s_t) of each response token, the entropy of π(·|s_t)), from one forward pass over prompt +
    response: z = logits / temperature in float32, as `generate` draws tokens, log π = log_softmax(z)."""
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_of(attention_mask), use_cache=False).logits[:, context_length - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, -1)
    with torch.no_grad():  # a statistic: no loss here takes the entropy's gradient
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, sequences[:, context_length:].unsqueeze(-1)).squeeze(-1), entropy


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


def forward_in_chunks(fn, size, *tensors):
    """fn over the rows of `tensors`, `size` rows at a time, the outputs concatenated. In a rollout the chunks
    are the rows the update passes through the model at once, so that they compute exactly what the update's
    forward passes will (the first PPO ratio is exactly 1)."""
    outs = [fn(*(t[i : i + size] for t in tensors)) for i in range(0, len(tensors[0]), size)]
    return tuple(torch.cat(parts) for parts in zip(*outs)) if isinstance(outs[0], tuple) else torch.cat(outs)


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


def join_samples(samples, pad_token_id):
    """Outputs of `generate`, (sequences, attention_mask, context_length, response_mask, sampler_logprobs), as one:
    the rows of all, the prompts left-padded to the longest and the responses right-padded to the longest."""
    width, length = max(s[2] for s in samples), max(s[3].shape[1] for s in samples)
    pad = lambda t, left, value: F.pad(t, (left, width + length - left - t.shape[1]), value=value)  # noqa: E731
    return (torch.cat([pad(s[0], width - s[2], pad_token_id) for s in samples]),
            torch.cat([pad(s[1], width - s[2], 0) for s in samples]), width,
            *(torch.cat([F.pad(s[k], (0, length - s[k].shape[1])) for s in samples]) for k in (3, 4)))


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
    if any(arg.split("=")[0] == "--sft-model-path" for arg in sys.argv[1:]) and os.environ.get("RANK", "0") == "0":
        print("note: --sft-model-path is now --model-name-or-path (TRL's name); the old name works in this release")
    main(tyro.cli(Args, description=__doc__))
