"""Agent GRPO: multi-turn tool-use RL, GRPO over whole episodes in which the policy calls tools.

The rollout is an episode, as TRL's GRPOTrainer runs one with `tools=`: the policy samples an assistant turn; if the
turn calls tools (Qwen's <tool_call>{"name": ..., "arguments": ...}</tool_call>), they run as Python functions, their
results are appended as the chat template renders a tool turn, and the policy samples the next turn, until a turn
calls none, --max-tool-calling-iterations rounds of calls, or --max-completion-length tokens in all. The G episodes of
a prompt are a group, and the reward of each (of its last answer) gives one advantage Â_i, as in grpo.py, spread over
the tokens the policy sampled and only those: the tool results and the template's tokens between turns, which the
environment wrote, have m_it = 0 in the policy loss, the KL term, the entropy, the token normalizers and the length
statistics (Shao et al. 2024, eq. 3, with |o_i| = Σ_t m_it):

    J = E[ (1/G) Σ_i (1/|o_i|) Σ_t m_it ( min( ρ_it Â_i, clip(ρ_it, 1 − ε, 1 + ε) Â_i ) − β D_KL,t[π_θ ‖ π_ref] ) ]

Token-exact: the ids trained on are the ids the sampler drew, turn after turn (a turn is never decoded and encoded
again), and a tool turn's ids are the chat template's rendering of that turn alone: the conversation rendered with it
less the conversation rendered without it, cut after the assistant's end of turn (tool_turn_ids). The built-in task,
offline: products of two or three numbers, which the tiny model cannot multiply and the tool `multiply` can; a product
of three takes two calls, the second on the first's result.

    python agent_grpo.py --write-sft-data data/tools.jsonl    # demonstrations of the built-in task, for sft.py
    python sft.py --dataset-name data/tools.jsonl --max-length 400 --max-steps 400 --batch-size 32 --warmup-steps 40 \\
        --output-dir models/sft_tools
    python agent_grpo.py                                       # GRPO with the tool, from models/sft_tools
    python agent_grpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset-name my.jsonl \\
        --tools my_tools.py:search,lookup --reward-fn my_rewards.py:correct --lr 1e-6 --max-prompt-length 1024

One process, one device; no scale/ sibling yet (scale/grpo.py holds the systems features for single-turn GRPO).
"""

import datetime
import decimal
import functools
import importlib
import inspect
import json
import math
import os
import random
import re
import runpy
import shutil
import socket
import sys
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
    """the name of this experiment, part of the run name runs/<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of python, torch and the built-in task's data"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    threads: int | None = None
    """torch CPU threads (default: OMP_NUM_THREADS where set, else one fewer than the cores, at least 1)"""
    progress: bool = True
    """on a terminal, a line every ~10 s: the iterations done, their rate, the time left and the batch's mean reward
    (--no-progress: none)"""
    model_name_or_path: str = "models/sft_tools"
    """hub id or local directory of the policy's start and the frozen reference: a chat model whose template renders
    tools (sft.py's output on --write-sft-data's demonstrations by default)"""
    tools: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """the tools, repeatable: MODULE_OR_FILE:NAME[,NAME...], Python functions with type hints and a docstring that
    documents each argument (their JSON schema: transformers.utils.get_json_schema), as TRL's tools=. None given:
    the built-in task's `multiply`"""
    tool_timeout: float = 10.0
    """seconds a tool call may take; a call that takes longer gets the result {"error": "timed out ..."}"""
    max_tool_calling_iterations: int | None = None
    """the most rounds of tool calls in an episode (TRL's name); a turn that calls tools after the last round ends
    the episode uncalled. None: no limit but --max-completion-length"""
    write_sft_data: str | None = None
    """write 20,000 demonstrations of the built-in task (TRL's format: `messages` with tool calls and tool turns, and
    `tools`) to this .jsonl file for sft.py, and exit"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a reward function, repeatable (the reward is the weighted sum): a built-in (exact_match, numeric_match, gold,
    format) or MODULE_OR_FILE:NAME of your own, fn(prompts, completions, **columns) -> list[float | None], as
    grpo.py's; a completion is the episode's messages after the prompt (assistant and tool turns, the answer last).
    None given: exact_match, the built-in task's gold reward"""
    reward_weights: tuple[float, ...] = ()
    """one weight per --reward-fn, in order; none given: all 1"""
    format_pattern: str | None = None
    """the regular expression of --reward-fn format, which the whole last answer must match"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or .json/.jsonl/.parquet file with a `prompt` column (conversational, or
    text: one user turn); its other columns reach the reward functions by name; None: the built-in task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several"""
    dataset_split: str = "train"
    """split of --dataset-name to draw prompts from"""
    output_dir: str = "models/agent_grpo"
    """where the trained policy is saved as a Hugging Face checkpoint (atomically)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    num_iterations: int = 120
    """rollout-then-update rounds"""
    num_generations: int = 8
    """G: episodes sampled per prompt; the group's rewards are each episode's baseline"""
    batch_size: int = 64
    """episodes per rollout (batch_size / G prompts)"""
    mini_batch_size: int = 32
    """episodes per gradient step"""
    ppo_epochs: int = 2
    """μ: passes over each rollout (TRL: num_iterations)"""
    lr: float = 3e-4
    """AdamW learning rate (a pretrained model wants ~1e-6)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over the iterations"""
    max_completion_length: int = 256
    """the most tokens of an episode after its prompt, the policy's and the tools' together (TRL's rule: a tool
    result that would leave no room for another turn is dropped and the episode ends; a turn is cut at the limit);
    L_max of dr_grpo"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens (the tools' schemas included) are dropped (and counted), never cut"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) compute in bfloat16 (autocast); weights and AdamW state float32"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training divide the logits by it too"""
    advantage: str = "grpo"
    """grpo, rloo, reinforce_pp, reinforce_pp_baseline or maxrl (rewards ≥ 0), as grpo.py's (compute_advantages)"""
    scale_rewards: str = "group"
    """divide GRPO's advantages by the group's std (group), the batch's (batch), or not (none, Dr. GRPO)"""
    no_scale_rewards: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """the older spelling of --scale-rewards none"""
    loss_type: str = "grpo"
    """grpo: mean over each episode's policy tokens, then over episodes; dapo: mean over all policy tokens of the
    rollout; dr_grpo: sum / (episodes × --max-completion-length); cispo, dppo, sapo, luspo, vespo: as grpo.py's
    (TRL: loss_type)"""
    importance_sampling_level: str = "token"
    """token: one ratio per token; sequence: GSPO's one ratio per episode, over its policy tokens"""
    epsilon: float = 0.2
    """ε of the clipped surrogate (the lower bound, and the upper one unless --epsilon-high is set)"""
    epsilon_high: float | None = None
    """upper clip bound 1 + ε_high (DAPO's clip-higher); with --loss-type cispo the weight's cap (TRL's meaning);
    with dppo, --epsilon and --epsilon-high are the trust region's δ_low and δ_high"""
    dppo_divergence: str = "binary_tv"
    """--loss-type dppo's divergence, binary_tv or binary_kl, as grpo.py's"""
    sapo_temperature_pos: float = 1.0
    """τ of --loss-type sapo's gate where Â > 0 (TRL's)"""
    sapo_temperature_neg: float = 1.05
    """τ of --loss-type sapo's gate where Â ≤ 0 (TRL's)"""
    vespo_k_pos: float = 2.0
    """k of --loss-type vespo's weight where Â ≥ 0 (TRL's)"""
    vespo_lambda_pos: float = 3.0
    """λ of --loss-type vespo's weight where Â ≥ 0 (TRL's)"""
    vespo_k_neg: float = 3.0
    """k of --loss-type vespo's weight where Â < 0 (TRL's)"""
    vespo_lambda_neg: float = 2.0
    """λ of --loss-type vespo's weight where Â < 0 (TRL's)"""
    beta: float = 0.04
    """β of the k3 KL penalty to the reference, on the policy's tokens only; 0 drops the reference model"""
    missing_eos_penalty: float = -1.0
    """the reward of an episode whose last turn was cut at --max-completion-length (no stop token): not scored"""
    mask_truncated_completions: bool = False
    """DAPO's overlong filtering: an episode cut at the limit gets no loss and no KL penalty"""
    rollout_lag: int = 0
    """K: sample each rollout with the policy's weights of K iterations before, as an asynchronous trainer does
    (grpo.py's); 0: on-policy"""
    vllm_importance_sampling_correction: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on when --rollout-lag > 0) weigh each policy token's loss by π_old/π_sampler, as grpo.py"""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's default), as grpo.py"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """C_max: the weight's upper bound; None: none (TRL's 3.0)"""
    vllm_importance_sampling_clip_min: float | None = None
    """C_min: the weight's lower bound; None: none (TRL's)"""
    off_policy_mask_threshold: float | None = None
    """δ of DeepSeek-V3.2's off-policy sequence masking, as grpo.py; None: off"""
    entropy_coef: float = 0.0
    """c of the entropy bonus over the policy's tokens, as grpo.py's (TRL's)"""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control, as grpo.py's (TRL's)"""
    entropy_target: float = 0.2
    """the entropy adaptive control holds (TRL's)"""
    entropy_coef_delta: float = 0.005
    """adaptive control's step of the coefficient (TRL's)"""
    entropy_coef_min: float = 0.0
    """adaptive control's least coefficient (TRL's)"""
    entropy_coef_max: float = 1.0
    """adaptive control's largest coefficient (TRL's)"""
    top_entropy_quantile: float = 1.0
    """ρ: the policy loss on the ρ fraction of policy tokens of highest entropy only (TRL's)"""
    cov_method: str | None = None
    """clip_cov or kl_cov, as grpo.py's; None: off"""
    clip_cov_ratio: float = 2e-4
    """clip_cov: the fraction of tokens detached (the paper's)"""
    clip_cov_lb: float = 1.0
    """clip_cov's lower bound of the covariance"""
    clip_cov_ub: float = 5.0
    """clip_cov's upper bound of the covariance"""
    kl_cov_ratio: float = 2e-3
    """kl_cov: the fraction of tokens penalized (the authors' 7B recipe's)"""
    kl_cov_coef: float = 1.0
    """kl_cov: β of the penalty β |log π_θ − log π_old|"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    eval_every: int = 20
    """evaluate every this many iterations (and before the first and after the last)"""
    eval_size: int = 256
    """eval prompts, 0 for no evaluation: the built-in task's own stream; a dataset's `test` split, or else prompts
    held out from the training ones"""




# ---------------------------------------------------------------------------------------------
# The math: pure functions. Rewards and advantages are [B] with the G episodes of a prompt in adjacent
# rows; token tensors are [B, T] over each episode's completion (every token after its prompt) with `mask`
# 1 on the tokens the policy sampled, its turns up to and including each turn's stop token, and 0 on the
# environment's (tool results, the template's tokens between turns) and on padding. grpo.py's functions,
# pasted; episode_tokens is this file's. Checked against hand-computed values in tests/test_agent_grpo.py.
# ---------------------------------------------------------------------------------------------
def episode_tokens(turns):
    """An episode's completion as the update sees it, from its turns in order, each (ids, sampled, logprobs): an
    assistant turn as the sampler drew it (sampled, its log π_sampler), or the environment's turn (not sampled):

        o = ids_1 ‖ ids_2 ‖ … ‖ ids_n,    m_t = 1 if token t is in a sampled turn, else 0
        log π_sampler(o_t) as drawn where m_t = 1, 0 where m_t = 0

    Returns (o, m, log π_sampler) as lists. Every loss, KL, entropy, normalizer and length of the update multiplies
    by m: the policy is trained on its own tokens only, conditioned on all."""
    ids = [t for turn, _, _ in turns for t in turn]
    mask = [float(sampled) for turn, sampled, _ in turns for _ in turn]
    logprobs = [lp for turn, sampled, lps in turns for lp in (lps if sampled else [0.0] * len(turn))]
    return ids, mask, logprobs


def group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """GRPO's advantage of completion i (Shao et al. 2024, section 4.1.2, outcome supervision), given to every
    one of its tokens; the group is the G completions of one prompt:

        Â_i = (r_i − mean(r)) / (std(r) + ε)      std over the group, with G − 1 in the denominator (as TRL)

    scale_rewards "none" (or False; Dr. GRPO, Liu et al. 2025): Â_i = r_i − mean(r). Dividing by the std gives
    groups whose rewards barely differ (prompts nearly always or nearly never solved) as much weight as the rest;
    "batch" divides by the std of all B rewards instead (TRL's scale_rewards="batch"), which does not. A group of
    equal rewards gets Â = 0: it teaches nothing. An unscored completion (reward NaN) is left out of its group's
    mean and std, as in TRL 1.16; its own Â is NaN until compute_advantages makes it 0."""
    groups = rewards.view(-1, num_generations)
    advantages = groups - groups.nanmean(1, keepdim=True)
    if scale_rewards in ("group", True):  # the std of the scored rewards (torch.std's own where every one is scored)
        scored = (~groups.isnan()).sum(1, keepdim=True)
        std = torch.where(scored == num_generations, groups.std(1, keepdim=True),
                          (advantages.nan_to_num() ** 2).sum(1, keepdim=True).div(scored - 1).sqrt())
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_moments(rewards)[1] + eps)
    return advantages.flatten()


def nanstd(x, dim):
    """The standard deviation along `dim` of the values of x that are not NaN, with n − 1 in the denominator (as
    TRL's nanstd), keeping the dimension."""
    count = (~x.isnan()).sum(dim, keepdim=True)
    return (((x - x.nanmean(dim, keepdim=True)) ** 2).nansum(dim, keepdim=True) / (count - 1)).sqrt()


def batch_moments(x):
    """(mean, std) of the values of x that are not NaN, the std with n − 1 in the denominator (TRL's nanstd over the
    whole batch)."""
    n = (~x.isnan()).sum().float()
    mean = x.nansum() / n
    return mean, (((x - mean) ** 2).nansum() / (n - 1)).sqrt()


def maxrl_advantages(rewards, num_generations, eps=1e-6):
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning"): the group's mean reward in place of
    its std,

        Â_i = (r_i − mean(r)) / (mean(r) + ε)

    With 0/1 rewards mean(r) is the pass rate p̂ of the prompt, and Σ_i Â_i ∇log π(o_i) / G = (1/K) Σ_correct ∇log π
    − (1/G) Σ_all ∇log π for K correct answers: an estimate of ∇log p (maximum likelihood) where GRPO estimates
    ∇p. A prompt solved 1 time in 8 weighs 7 times one solved 7 times in 8. Rewards must not be negative
    (check_args). A group of zeros gets Â = 0; unscored completions (NaN) are left out, as in group_advantages."""
    groups = rewards.view(-1, num_generations)
    mean = groups.nanmean(1, keepdim=True)
    return ((groups - mean) / (mean + eps)).flatten()


def normalize_then_sum(table, weights, num_generations, eps=1e-4):
    """GDPO's advantage (arXiv 2601.05242) from K reward terms, as TRL 1.16's multi_objective_aggregation=
    "normalize_then_sum": each term normalized within its group first, so that a term of small spread is not
    drowned by one of large spread in the sum, then the weighted sum normalized over the batch,

        A_i = Σ_k w_k (r_ik − mean_g(r_k)) / (std_g(r_k) + ε),    Â_i = (A_i − mean_B(A)) / (std_B(A) + ε)

    `table` is [B, K] with NaN where a term does not apply (left out of its statistics, adding 0 to the sum); a
    completion no term applies to gets NaN, as in combine_rewards. Stds with n − 1 in the denominator; mean_B and
    std_B over the whole batch (batch_moments)."""
    groups = table.view(-1, num_generations, table.shape[1])
    normalized = (groups - groups.nanmean(1, keepdim=True)) / (nanstd(groups, 1) + eps)
    summed = (normalized.view_as(table) * torch.as_tensor(weights, dtype=table.dtype, device=table.device)).nansum(1)
    summed = summed.masked_fill(table.isnan().all(1), math.nan)
    mean, std = batch_moments(summed)
    return (summed - mean) / (std + eps)


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


def compute_advantages(rewards, num_generations, advantage, scale_rewards, table=None, weights=None):
    """Â_i of each completion by --advantage: grpo (group_advantages, with --scale-rewards none Dr. GRPO's), rloo
    (rloo_advantages), reinforce_pp and reinforce_pp_baseline (reinforce_pp_advantages, over the whole batch),
    maxrl (maxrl_advantages); given the reward terms' `table` and `weights`, GDPO's (normalize_then_sum).
    An unscored completion (reward NaN: no reward function applies to it) gets Â = 0, as in TRL 1.16: it moves
    nothing, and the others' baselines leave it out."""
    if table is not None:
        advantages = normalize_then_sum(table, weights, num_generations)
    elif advantage == "maxrl":
        advantages = maxrl_advantages(rewards, num_generations)
    elif advantage == "rloo":
        advantages = rloo_advantages(rewards, num_generations)
    elif advantage.startswith("reinforce_pp"):
        advantages = reinforce_pp_advantages(rewards, num_generations, advantage == "reinforce_pp_baseline")
    else:
        advantages = group_advantages(rewards, num_generations, scale_rewards)
    return advantages.nan_to_num(0.0)


def sampler_importance_weights(old_logprobs, sampler_logprobs, mask, mode, clip_min, clip_max):
    """The weight of each token's loss that corrects for sampling from π_sampler (weights --rollout-lag iterations
    old, or another engine's kernels) instead of π_old, the policy the update starts from, [B, T], detached:

        token_truncate     w_t = clip(ρ_t, C_min, C_max)              TIS (Yao et al. 2025)
        token_mask         w_t = ρ_t · 1[C_min ≤ ρ_t ≤ C_max]          MIS
        sequence_truncate  w_i = clip(ρ_i, C_min, C_max)              at every token of o_i
        sequence_mask      w_i = ρ_i · 1[C_min ≤ ρ_i ≤ C_max]

    with ρ_t = π_old(o_t | q, o_<t) / π_sampler(o_t | q, o_<t) and ρ_i = Π_t ρ_t, the whole completion's ratio (a
    product, not GSPO's geometric mean). As TRL 1.16's vllm_importance_sampling_mode; C_min or C_max None: no bound
    on that side."""
    log_ratio = (old_logprobs - sampler_logprobs) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio)
    low, high = -math.inf if clip_min is None else clip_min, math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(low, high)
    return ratio * ((ratio >= low) & (ratio <= high))


def off_policy_sequence_mask(advantages, logprobs, sampler_logprobs, mask, delta):
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, arXiv 2512.02556, eq. 9): leave out of the loss
    a completion with a negative advantage that the policy has moved far from, measured from the sampler's tokens,

        M_i = 0  if Â_i < 0 and (1/|o_i|) Σ_t log( π_sampler(o_t | q, o_<t) / π_θ(o_t | q, o_<t) ) > δ;  else 1

    A negative advantage on tokens π_θ already finds unlikely pushes them down further on noise; a positive one
    is always kept. [B, 1]; π_θ detached. As TRL 1.16's off_policy_mask_threshold (δ)."""
    kl = ((sampler_logprobs - logprobs.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return ((advantages.unsqueeze(1) >= 0) | (kl <= delta)).to(mask.dtype)


def sampler_mismatch(old_logprobs, sampler_logprobs, mask, bound):
    """How far the sampler is from the policy the update starts from, over the rollout's tokens, for the rollout/
    tags: the sum and the max of |log π_sampler − log π_old|, the sum of k3, the per-token estimate of
    KL[π_sampler ‖ π_old] on the sampler's own tokens (log r = log π_old − log π_sampler, k3 = r − 1 − log r), and
    the number of tokens whose ratio π_old/π_sampler lies outside [1/C, C], C = `bound`. Sums, not means, so that
    ranks add up; the tags divide by the tokens."""
    log_r = (old_logprobs - sampler_logprobs) * mask
    return (log_r.abs().sum(), log_r.abs().max(), ((log_r.exp() - 1 - log_r) * mask).sum(),
            ((log_r.abs() > math.log(bound)) * mask).sum())


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


def dppo_trust_region(logprobs, sampler_logprobs, advantages, divergence, delta_low, delta_high):
    """DPPO's trust region (arXiv 2602.04879, as prime-rl's and verl's dppo losses): 1 where token t may learn, 0
    where π_θ has moved past δ from the sampler in the direction its advantage pushes (further would be unsafe),

        M_t = 0  if Â > 0 and p_θ > p_s and D_t > δ_high,   or  Â ≤ 0 and p_θ < p_s and D_t > δ_low;   else 1

    with p = π(o_t | q, o_<t) the sampled token's probability under π_θ (detached) and the sampler, and D_t the
    divergence of the two Bernoulli(p) distributions of "this token or another": binary_tv |p_θ − p_s|,
    binary_kl p_s log(p_s/p_θ) + (1 − p_s) log((1 − p_s)/(1 − p_θ)). The ratio's clip judges a rare token by
    a ratio that moves a lot for a small change of its probability; the divergence, by the probability itself.
    A token moving back toward the sampler always learns. [B, T]."""
    p, q = logprobs.detach().exp(), sampler_logprobs.exp()
    if divergence == "binary_tv":
        distance = (p - q).abs()
    else:  # the Bernoulli KL, in log space where p and q are near 1
        distance = q * (sampler_logprobs - logprobs.detach()) + (1 - q) * (torch.log1p(-q.clamp(max=1 - 1e-7))
                                                                         - torch.log1p(-p.clamp(max=1 - 1e-7)))
    advantages = advantages.unsqueeze(1)
    unsafe = torch.where(advantages > 0, (p > q) & (distance > delta_high), (p < q) & (distance > delta_low))
    return (~unsafe).to(logprobs.dtype)


def sapo_loss(ratio, advantages, temperature_pos, temperature_neg):
    """SAPO (arXiv 2511.20347, "Soft Adaptive Policy Optimization"), as TRL 1.16's loss_type="sapo": a sigmoid gate
    of the ratio in place of the hard clip, so a token's gradient fades as its ratio leaves 1 instead of stopping,

        l_t = −(4/τ) σ(τ (ρ_t − 1)) Â,    τ = τ_pos where Â > 0, else τ_neg

    whose gradient at ρ = 1 is −Â ∇ρ, the unclipped surrogate's; a larger τ_neg fades negative tokens sooner."""
    advantages = advantages.unsqueeze(1)
    temperature = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages


@torch.no_grad()
def vespo_weights(log_ratio, mask, advantages, is_weights, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's weight of each completion (arXiv 2602.10693; TRL 1.16's loss_type="vespo"), one smooth function
    of the completion's whole importance ratio w in place of a clip, detached:

        φ(w) = e^λ w^k e^(−λ w) = exp(λ + k log w − λ w),   w = Π_t ρ_t · Π_t π_old/π_sampler (the sampler correction)

    φ(1) = 1; it peaks at w = k/λ and falls toward 0 far from it on either side. (k, λ) = (k_pos, λ_pos) where
    Â ≥ 0, else (k_neg, λ_neg). log ρ_t clamped to ±20 and log w to [log 1e-8, 20], as TRL. [B, 1]."""
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(1, keepdim=True)
    if is_weights is not None:  # TRL sums the correction's log-weights over every position (1 on padding)
        log_w = log_w + is_weights.log().clamp(math.log(1e-8), 20.0).sum(1, keepdim=True)
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    positive = advantages.unsqueeze(1) >= 0
    k, lam = torch.where(positive, k_pos, k_neg), torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)


def token_losses(ratio, logprobs, advantages, loss_type, epsilon_low, epsilon_high, weights=None,
                 temperatures=(1.0, 1.05)):
    """The per-token loss l_t by --loss-type: CISPO's (cispo_loss) for cispo; −sg(φ_i) Â log π_θ for vespo, with
    `weights` φ (vespo_weights); SAPO's gate (sapo_loss, `temperatures` τ_pos, τ_neg) for sapo; the plain
    surrogate −ρ_t Â for dppo (dppo_trust_region's mask drops tokens instead of a clip); else the clipped
    surrogate (clipped_surrogate: grpo, dapo, dr_grpo, luspo). aggregate_loss then makes them one number."""
    if loss_type == "cispo":
        return cispo_loss(ratio, logprobs, advantages, epsilon_high)
    if loss_type == "vespo":
        return -weights * advantages.unsqueeze(1) * logprobs
    if loss_type == "sapo":
        return sapo_loss(ratio, advantages, *temperatures)
    if loss_type == "dppo":
        return -ratio * advantages.unsqueeze(1)
    return clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)


def clipped_tokens(ratio, advantages, epsilon_low, epsilon_high, loss_type):
    """(low, high): where the clip is active on each side. The clipped surrogate cuts a token's gradient when ρ_t
    falls below 1 − ε_low with Â < 0 (low) or rises above 1 + ε_high with Â > 0 (high); out of the band on the
    other side, min() keeps the unclipped term. As TRL counts them. CISPO caps the weight above ε_high only; sapo,
    vespo and dppo have no clip (dppo's dropped tokens are counted apart)."""
    if loss_type in ("cispo", "sapo", "vespo", "dppo"):
        return torch.zeros_like(ratio, dtype=torch.bool), ratio > (epsilon_high if loss_type == "cispo" else math.inf)
    advantages = advantages.unsqueeze(1)
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def aggregate_loss(per_token_loss, mask, loss_type, num_sequences, num_tokens, max_completion_length):
    """The per-token losses l_it of a (micro-)batch as one number. The normalizers are those of the whole
    minibatch, so that the losses of its micro-batches (and ranks) add up to its loss:

        grpo      (1/B) Σ_i (1/|o_i|) Σ_t l_it     mean over each completion, then over completions (eq. 3)
        dapo      Σ_i Σ_t l_it / N                 every token of the rollout weighs the same (Yu et al. 2025)
        dr_grpo   Σ_i Σ_t l_it / (B · L_max)       a constant normalizer: no length bias (Liu et al. 2025)
        cispo     Σ_i Σ_t l_it / N                 as dapo, with CISPO's per-token loss (MiniMax-M1, 2025)
        dppo      Σ_i Σ_t l_it / N                 as dapo (prime-rl's and verl's token mean)
        vespo     Σ_i Σ_t l_it / N                 as dapo (TRL 1.16)
        sapo      (1/B) Σ_i (1/|o_i|) Σ_t l_it     as grpo (TRL 1.16)
        luspo     (1/B) Σ_i Σ_t l_it               GSPO's loss scaled by each length (LUSPO, arXiv 2602.05261)

    B = `num_sequences` completions in the minibatch; N = `num_tokens`, the rollout's tokens ÷ its minibatches,
    as TRL 1.16 (a minibatch's own token count would weigh a token of a short minibatch more); L_max =
    `max_completion_length`. Under grpo a long wrong answer is penalized less per token than a short one."""
    summed = (per_token_loss * mask).sum(1)
    if loss_type in ("grpo", "sapo"):
        return (summed / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type in ("dapo", "cispo", "dppo", "vespo"):
        return summed.sum() / num_tokens
    if loss_type == "luspo":
        return summed.sum() / num_sequences
    if loss_type == "dr_grpo":
        return summed.sum() / (num_sequences * max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}")


def high_entropy_mask(entropy, mask, quantile):
    """The 80/20 rule (Wang et al. 2025, "Beyond the 80/20 Rule"), as TRL 1.16's top_entropy_quantile ρ: True on the
    tokens whose entropy H(π_θ(·|s_t)) is at least the (1 − ρ) quantile of the entropies of the `mask`ed tokens
    (linear interpolation, torch.quantile's), False elsewhere and on padding. The forking tokens where the policy
    hesitates carry the gradient; ρ = 0 keeps the highest one only."""
    values = entropy.detach()[mask.bool()]
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    return (entropy.detach() >= torch.quantile(values.float(), 1 - quantile)) & mask.bool()


def entropy_bonus(entropy, mask):
    """H̄, the mean entropy over the `mask`ed tokens, whose coefficient times it the loss subtracts (TRL 1.16's
    entropy_coef: the same mean whatever --loss-type's normalizer). A scalar with the gradient of `entropy`."""
    return (entropy * mask).sum() / mask.sum().clamp(min=1)


def adaptive_entropy_coef(coef, entropy, target, delta, low, high):
    """Skywork-OR1's adaptive entropy control (arXiv 2505.22312), as TRL 1.16's use_adaptive_entropy:
    after each optimizer step the coefficient moves by δ toward holding the entropy at the target,

        c ← min(c + δ, c_max)  if H̄ ≤ target,   else  max(c − δ, c_min)

    and the next step applies c only while H̄ ≤ target (0 otherwise)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def token_covariance(advantages, logprobs, mask):
    """Each token's term of the covariance between log π_θ and the advantage over the `mask`ed tokens of a minibatch
    (Cui et al. 2025, "The Entropy Mechanism of RL for LLM Reasoning", arXiv 2505.22617), detached,

        Cov_t = (log π_θ(o_t) − mean(log π_θ)) · (Â_t − mean(Â))

    Entropy falls in a step by about the sum of these (their analysis): a token that is likely and rewarded, or
    unlikely and punished, lowers it. Clip-Cov and KL-Cov act on the tokens of largest Cov_t. [B, T]."""
    advantages, logprobs = advantages.unsqueeze(1).expand_as(mask), logprobs.detach()
    n = mask.sum().clamp(min=1)
    return (logprobs - (logprobs * mask).sum() / n) * (advantages - (advantages * mask).sum() / n) * mask


def clip_cov_tokens(covariance, mask, cut, ratio, low, high):
    """Clip-Cov's tokens (Cui et al. 2025; as verl's clip_cov): r·N of the N `mask`ed tokens, at least one,
    drawn at random among those whose Cov_t lies strictly between `low` and `high` and whose gradient the loss does
    not already `cut` (the clip); they get no gradient. True on those chosen. Draws from torch's generator."""
    candidates = ((covariance > low) & (covariance < high) & mask.bool() & ~cut).flatten().nonzero().squeeze(1)
    count = max(int(ratio * mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates), device=mask.device)[:count]]
    return torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device).index_fill_(0, chosen, True).view_as(mask)


def kl_cov_tokens(covariance, mask, ratio):
    """KL-Cov's tokens (Cui et al. 2025; as verl's kl_cov): the k·N `mask`ed tokens of largest Cov_t, at
    least one; each gets the penalty β |log π_θ(o_t) − log π_old(o_t)|. True on those chosen."""
    count = max(int(ratio * mask.sum().item()), 1)
    chosen = covariance.masked_fill(~mask.bool(), -math.inf).flatten().topk(count).indices
    return torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device).index_fill_(0, chosen, True).view_as(mask)


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


BUILTIN_REWARDS = {"gold": gold, "exact_match": exact_match, "numeric_match": numeric_match, "format": format_match}


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
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    for name, least in {"num_iterations": 1, "num_generations": 2, "mini_batch_size": 1, "batch_size": 1,
                        "ppo_epochs": 1, "max_completion_length": 1, "max_prompt_length": 1, "eval_every": 1,
                        "eval_size": 0, "rollout_lag": 0}.items():
        if getattr(args, name) < least:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        sys.exit(f"error: --max-tool-calling-iterations {args.max_tool_calling_iterations}: 0 or more (0: no calls "
                 "run)")
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "temperature": "> 0", "beta": ">= 0", "epsilon": "> 0",
                       "epsilon_high": "> 0", "tool_timeout": "> 0", "vllm_importance_sampling_clip_max": ">= 0",
                       "vllm_importance_sampling_clip_min": ">= 0", "off_policy_mask_threshold": ">= 0",
                       "sapo_temperature_pos": "> 0", "sapo_temperature_neg": "> 0", "vespo_k_pos": ">= 0",
                       "vespo_k_neg": ">= 0", "vespo_lambda_pos": "> 0", "vespo_lambda_neg": "> 0",
                       "entropy_coef": ">= 0", "entropy_target": ">= 0", "entropy_coef_delta": ">= 0",
                       "entropy_coef_min": ">= 0", "entropy_coef_max": ">= 0", "clip_cov_ratio": "> 0",
                       "kl_cov_ratio": "> 0", "kl_cov_coef": ">= 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    for flag, value, choices in (("--advantage", args.advantage, ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                                                  "maxrl")),
                                 ("--loss-type", args.loss_type, ("grpo", "dapo", "dr_grpo", "cispo", "dppo", "sapo",
                                                                  "luspo", "vespo")),
                                 ("--importance-sampling-level", args.importance_sampling_level, ("token", "sequence")),
                                 ("--vllm-importance-sampling-mode", args.vllm_importance_sampling_mode,
                                  ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")),
                                 ("--scale-rewards", args.scale_rewards, ("group", "batch", "none", True, False)),
                                 ("--dppo-divergence", args.dppo_divergence, ("binary_tv", "binary_kl")),
                                 ("--cov-method", args.cov_method, (None, "clip_cov", "kl_cov"))):
        if value not in choices:
            sys.exit(f"error: {flag} {value!r}: choose one of {', '.join(map(str, choices))}")
    if args.scale_rewards not in ("group", True) and args.advantage != "grpo":
        sys.exit(f"error: --scale-rewards {args.scale_rewards} changes --advantage grpo only; --advantage "
                 f"{args.advantage} has its own scale")
    if args.advantage == "maxrl" and args.missing_eos_penalty < 0:
        sys.exit(f"error: --advantage maxrl divides by the group's mean reward, a pass rate: rewards must not be "
                 f"negative; set --missing-eos-penalty 0 (it is {args.missing_eos_penalty})")
    if not 0 <= args.top_entropy_quantile <= 1 or args.entropy_coef_min > args.entropy_coef_max \
            or not args.clip_cov_lb < args.clip_cov_ub:
        sys.exit(f"error: --top-entropy-quantile {args.top_entropy_quantile} must lie in [0, 1], --entropy-coef-min "
                 "not exceed --entropy-coef-max, and --clip-cov-lb be below --clip-cov-ub")
    if args.loss_type in ("dppo", "vespo") and args.importance_sampling_level == "sequence" or (
            args.loss_type == "vespo" and args.vllm_importance_sampling_correction
            and args.vllm_importance_sampling_mode.startswith("sequence")):
        sys.exit(f"error: --loss-type {args.loss_type} takes each token's own ratio: use --importance-sampling-level "
                 "token (and with vespo a token_* --vllm-importance-sampling-mode)")
    if args.loss_type == "cispo" and (args.epsilon_high is None or args.importance_sampling_level == "sequence"):
        sys.exit("error: --loss-type cispo caps each token's weight at --epsilon-high (set it, e.g. 5.0) and needs "
                 "--importance-sampling-level token")
    if args.batch_size % args.num_generations or args.batch_size % args.mini_batch_size:
        sys.exit(f"error: --batch-size {args.batch_size} must split into groups of --num-generations "
                 f"{args.num_generations} and into minibatches of --mini-batch-size {args.mini_batch_size}")
    if args.dataset_name is not None and not (args.tools and args.reward_fn):
        sys.exit("error: a dataset needs its tools (--tools my_tools.py:NAME,...) and a reward (--reward-fn "
                 "exact_match, numeric_match, or my_rewards.py:fn)")
    if args.reward_weights and len(args.reward_weights) != max(1, len(args.reward_fn)):
        sys.exit(f"error: --reward-weights has {len(args.reward_weights)} values for {max(1, len(args.reward_fn))} "
                 "reward functions (one per --reward-fn, in order)")
    if not all(map(math.isfinite, (args.missing_eos_penalty, *args.reward_weights))):
        sys.exit(f"error: --missing-eos-penalty {args.missing_eos_penalty}, --reward-weights {list(args.reward_weights)}: "
                 "each must be a finite number")


def main(args: Args):
    settle_defaults(args)  # --bf16 and --vllm-importance-sampling-correction, where not given
    check_args(args)
    if args.write_sft_data:
        return write_demonstrations(args.write_sft_data, args.seed)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    tools = load_tools(args.tools) if args.tools else {"multiply": multiply}  # the built-in task's calculator
    functions = load_reward_functions(args.reward_fn or ("exact_match",), BUILTIN_REWARDS, args.format_pattern)
    weights = args.reward_weights or (1.0,) * len(functions)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    G, B = args.num_generations, args.batch_size
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the sampling
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # Prompts and their columns, the tools' schemas, the models, and a template that can carry an episode
    train_rows, eval_rows = load_data(args, tool_task_row, 50_000, [("prompt",)], "needs a `prompt` column")
    check_reward_signatures(functions, sorted(train_rows[0]) if train_rows else [])
    schemas = tool_schemas(tools)
    tokenizer, stop_ids, policy, ref = load_models(args, device)
    check_tool_template(tokenizer, schemas, stop_ids, args.model_name_or_path)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, train_ids = tokenize_tool_prompts(tokenizer, train_rows, schemas, args.max_prompt_length, "train")
    if len(train_ids) < B // G:
        sys.exit(f"error: {len(train_ids)} training prompts fit --max-prompt-length {args.max_prompt_length}, fewer "
                 f"than the {B // G} of a batch; raise it (the tools' schemas are in every prompt) or lower --batch-size")
    eval_rows, eval_ids = tokenize_tool_prompts(tokenizer, eval_rows, schemas, args.max_prompt_length, "eval")
    positions, longest = model_positions(policy), max(len(ids) for ids in train_ids + eval_ids)
    if positions is not None and longest + args.max_completion_length > positions:
        sys.exit(f"error: the longest prompt ({longest} tokens) + --max-completion-length {args.max_completion_length} "
                 f"exceeds the model's {positions} positions; lower --max-prompt-length or --max-completion-length")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    lag = RolloutLag(policy, args)  # --rollout-lag K: the weights a rollout samples with
    control = EntropyControl(args)  # --entropy-coef, --use-adaptive-entropy: the entropy bonus
    writer = SummaryWriter(f"runs/{args.exp_name}__{args.seed}__{int(time.time())}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{1 + (ref is not None)} model(s) in memory; tools: {', '.join(tools)}")
    terms = RewardTerms(functions, weights, None, [name for name, _ in functions])
    env = Environment(tokenizer, tools, schemas, stop_ids)

    def logprobs_of(model, sequences, attention_mask, context_length):
        """(log π(a_t | s_t), entropy) of every completion token, the environment's too (the mask drops them), a
        minibatch at a time: in a rollout these are exactly the update's forward passes."""
        return forward_in_chunks(lambda s, a: policy_logprobs(model, s, a, context_length, args.temperature),
                                 args.mini_batch_size, sequences, attention_mask)

    # ---- the loop: an evaluation before any update, then sample, advantages, update and log each iteration -----
    evaluate(policy, env, eval_rows, eval_ids, terms, amp, writer, 0, args)
    rng, start_time = random.Random(args.seed), time.time()  # rng: the prompts drawn
    progress = Progress(args.num_iterations, "iterations", args.progress)
    for iteration in range(1, args.num_iterations + 1):
        lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr
        optimizer.param_groups[0]["lr"] = lr
        # ---- 1. sample episodes: G of each prompt, the tools run between turns, and their rewards ------------
        policy.eval()
        with torch.no_grad(), amp():
            chosen = [i for i in rng.sample(range(len(train_ids)), B // G) for _ in range(G)]
            with lag:  # --rollout-lag K: sampled with the weights of K iterations before
                batch = sample_episodes(policy, env, [train_rows[i] for i in chosen], [train_ids[i] for i in chosen],
                                        terms, args)
            # ---- 2. advantages within each group, and the policy the update starts from (on every token) ---
            advantages = compute_advantages(batch.rewards, G, args.advantage, args.scale_rewards)
            old = old_policy(policy, ref, batch, logprobs_of, args)

        # ---- 3. update: μ passes over the rollout in shuffled minibatches, on the policy's tokens only --------
        policy.train()
        stats = {k: 0.0 for k in ("policy_loss", "kl_penalty", "clipped_low", "clipped_high", "off_policy_masked",
                                  "dppo_masked", "cov_selected", "policy_entropy", "bonus")}
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(B, device=device) if epoch > 0 else torch.arange(B, device=device)
            for start in range(0, B, args.mini_batch_size):
                mb = order[start : start + args.mini_batch_size]
                with amp():
                    logprobs, entropy = policy_logprobs(policy, batch.sequences[mb], batch.attention_mask[mb],
                                                        batch.context_length, args.temperature, control.on)
                ratio = importance_ratio(logprobs, old.logprobs[mb], batch.mask[mb], args.importance_sampling_level)
                per_token, counts = grpo_token_losses(ratio, logprobs, entropy, advantages[mb], batch, old, mb,
                                                      epsilon_high, args)
                policy_loss = aggregate_loss(per_token, batch.loss_mask[mb], args.loss_type, args.mini_batch_size,
                                             batch.num_tokens, args.max_completion_length)
                kl_penalty = kl_to_reference(logprobs, old.ref_logprobs, batch.loss_mask, mb, batch.num_tokens,
                                             args.max_completion_length, args)
                (policy_loss + kl_penalty - control.bonus(entropy, batch.loss_mask[mb], counts)).backward()
                accumulate_grpo_stats(stats, policy_loss, kl_penalty, ratio, advantages[mb], batch.mask[mb], counts,
                                      epoch == start == 0, epsilon_high, args)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                check_finite(iteration, loss=policy_loss + kl_penalty, grad_norm=grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        # ---- 4. log: statistics of the whole batch, the policy's tokens and the tools' apart ----------------
        log_agent_iteration(writer, iteration, batch, old, stats, terms.names, lr, start_time, control, args)
        progress(iteration, f"reward {float(batch.rewards.nanmean()):.3f}")
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            evaluate(policy, env, eval_rows, eval_ids, terms, amp, writer, iteration, args)

    save_model(policy, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


# ---------------------------------------------------------------------------------------------
# Tools: Python functions the policy calls, as TRL's tools=. The chat template renders their JSON schemas (from
# type hints and the docstring: transformers.utils.get_json_schema) and the calls; a turn's calls are parsed from
# the template's format; each runs with a timeout, and whatever goes wrong becomes its result {"error": ...}, which
# the policy reads in the next turn, as TRL's. A tool turn's ids are the template's rendering of that turn alone.
# ---------------------------------------------------------------------------------------------
CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)  # Qwen2.5/Qwen3's; one cut short too


def parse_calls(text):
    """(content, tool calls) of an assistant turn's text in Qwen2.5/Qwen3's format: each <tool_call>{"name": ...,
    "arguments": {...}}</tool_call>, as TRL's tool_calls ({"type": "function", "function": {"name", "arguments"}}),
    the text around them the content. A call that is not such JSON (or is never closed) is kept, with an "error"
    saying why: call_tool answers it with the error, and it counts as a failed call."""
    calls = []
    for block, closed in CALL.findall(text):
        try:
            if not closed:
                raise ValueError("never closed")
            call = json.loads(block)
            arguments = call.get("arguments", {})
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not isinstance(call["name"], str) or not isinstance(arguments, dict):
                raise TypeError("the name must be text and the arguments an object")
            calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = first_line(e) if closed else "never closed"
            calls.append({"type": "function", "function": {"name": "", "arguments": {}},
                          "error": f"not JSON with a name and arguments ({why})"})
    return CALL.sub("", text).strip(), calls


def parse_turn(tokenizer, ids):
    """The assistant message of a sampled turn's ids, {"role", "content", "tool_calls"}: parsed by transformers'
    parse_response where the tokenizer has a response template (a parse that fails is text: no calls), else by
    parse_calls. The ids are decoded here to read the calls, never to be trained on."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(text, prefix="")
            return {"role": "assistant", "content": parsed.get("content") or "",
                    "tool_calls": parsed.get("tool_calls") or []}
        except Exception:  # noqa: BLE001  what the parser cannot read is the turn's text, without calls
            return {"role": "assistant", "content": text, "tool_calls": []}
    content, calls = parse_calls(text)
    return {"role": "assistant", "content": content, "tool_calls": calls}


def call_tool(tools, call, timeout):
    """(the result as a tool turn's content, whether the call failed) of one call: the function's return value as
    text (a dict or a list as JSON), or {"error": ...} (TRL's) for a call that is not JSON, an unknown tool,
    arguments the function does not take, an exception it raises, or more than `timeout` seconds (the call is
    left to finish in a daemon thread: Python cannot stop it)."""
    function, outcome = call["function"], {}
    error = call.get("error")
    if error is None and function["name"] not in tools:
        error = f"unknown tool {function['name']!r} (the tools: {', '.join(tools)})"
    if error is None:
        def run():
            try:
                outcome["result"] = tools[function["name"]](**function["arguments"])
            except Exception as e:  # noqa: BLE001  the tool's failure is the policy's to read
                outcome["error"] = f"{type(e).__name__}: {first_line(e)}"
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
        error = outcome.get("error", None if "result" in outcome else f"timed out after {timeout:g} s")
    if error is not None:
        return json.dumps({"error": error}), True
    result = outcome["result"]
    return json.dumps(result) if isinstance(result, (dict, list)) else str(result), False


def tool_turn_ids(tokenizer, messages, results, schemas, stop_ids):
    """The ids of the tool turn that answers the last assistant turn of `messages` with the tool messages
    `results`, as the chat template renders that turn alone: the conversation rendered with the results and the
    next assistant header, less the conversation rendered without them up to the assistant turn's last stop token.
    What the template writes after that token (ChatML's "\\n") belongs to the tool turn: the sampled turn ended at
    its stop token, and dropping the separator would train on a sequence the template never makes. None where the
    template renders the conversation before the results differently once they are there (it would re-tokenize a
    boundary, or re-render a past turn), or ends the assistant's turn with no stop token: the tool turn's ids would
    not continue the sampled ones."""
    before = render_chat(tokenizer, messages, tools=schemas)
    after = render_chat(tokenizer, messages + results, add_generation_prompt=True, tools=schemas)
    turn_start = len(render_chat(tokenizer, messages[:-1], add_generation_prompt=True, tools=schemas))
    ends = [i for i, t in enumerate(before) if t in stop_ids and i >= turn_start]
    if not ends or after[: ends[-1] + 1] != before[: ends[-1] + 1]:
        return None
    return after[ends[-1] + 1 :]


def load_tools(specs):
    """{name: function} of --tools MODULE_OR_FILE:NAME[,NAME...], each a function in a .py file (by path) or an
    importable module, as --reward-fn loads them. What cannot be found or imported, or a function without type
    hints or a docstring for its arguments (no JSON schema to render), is one line, before any model is loaded."""
    from transformers.utils import get_json_schema

    tools = {}
    for spec in specs:
        source, _, names = spec.rpartition(":")
        if not source or not names:
            sys.exit(f"error: --tools {spec!r}: name your functions as MODULE_OR_FILE:NAME[,NAME...] (e.g. "
                     "my_tools.py:search,lookup)")
        if source.endswith(".py") and not os.path.isfile(source):
            sys.exit(f"error: --tools {spec!r}: the file {source!r} does not exist")
        if not source.endswith(".py") and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a module of the directory the run starts in
        try:
            namespace = runpy.run_path(source) if source.endswith(".py") else vars(importlib.import_module(source))
        except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
            sys.exit(f"error: --tools {spec!r}: importing {source!r} failed: {type(e).__name__}: {first_line(e)}")
        for name in names.split(","):
            if not callable(namespace.get(name)):
                sys.exit(f"error: --tools {spec!r}: {source!r} has no function {name!r}")
            try:
                get_json_schema(namespace[name])
            except Exception as e:  # noqa: BLE001  transformers' own exceptions for a missing hint or docstring
                sys.exit(f"error: --tools {spec!r}: {first_line(e).rstrip('.!')}; a tool needs type hints and a "
                         "docstring whose Args section describes each argument (its JSON schema), as TRL's tools")
            if name in tools:
                sys.exit(f"error: --tools: {name!r} is given twice")
            tools[name] = namespace[name]
    return tools


def tool_schemas(tools):
    """The JSON schema of each tool, as the chat template renders them (TRL's tools= and sft.py's `tools` column)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools.values()]


def check_tool_template(tokenizer, schemas, stop_ids, path):
    """One line, before any work, where the chat template of the model at `path` cannot carry an episode: it does
    not render the tools, a call or a tool's result, or it renders a tool turn so that the turn's ids cannot continue
    the sampled ones (tool_turn_ids)."""
    name = schemas[0]["function"]["name"]
    call = {"type": "function", "function": {"name": name, "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    result = [{"role": "tool", "name": name, "content": "probe result 6"}]
    hint = f"error: the chat template of {path!r}"
    if tokenizer.chat_template is None:
        sys.exit(f"{hint} is missing: tool use needs a chat model whose template renders tools (Qwen2.5 and later)")
    if name not in tokenizer.decode(render_chat(tokenizer, messages[:1], add_generation_prompt=True, tools=schemas)):
        sys.exit(f"{hint} does not render tools (apply_chat_template(tools=...) leaves them out); use a chat model "
                 "with tool support (Qwen2.5 and later)")
    suffix = tool_turn_ids(tokenizer, messages, result, schemas, stop_ids)
    if suffix is None:
        sys.exit(f"{hint} renders the conversation before a tool turn differently once the turn is there (or ends the "
                 "assistant's turn with no stop token), so a tool turn's ids cannot continue the sampled ones")
    rendered = tokenizer.decode(render_chat(tokenizer, messages, tools=schemas))
    if name not in rendered[len(tokenizer.decode(render_chat(tokenizer, messages[:1], tools=schemas))) :] \
            or "probe result 6" not in tokenizer.decode(suffix):
        sys.exit(f"{hint} does not render an assistant's tool calls or a tool's result (a `tool` message)")


# ---------------------------------------------------------------------------------------------
# The built-in task: products of two or three numbers, with a calculator. The byte-level model of sft.py
# cannot multiply 37 by 48 (without the tool its accuracy is near 0), but it can copy factors into a call and a
# result into its answer; a product of three takes two calls, the second on the first's result, so that every
# such episode is multi-turn. Its gold reward is exact_match against the `target`.
# ---------------------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    if not isinstance(a, int) or not isinstance(b, int):
        raise TypeError(f"multiply takes two integers, not {a!r} and {b!r}")
    return a * b


def tool_task_row(rng):
    """A prompt a*b (one call) or a*b*c (two calls), a and b in [11, 99] and c in [2, 9], and its `target`, the
    product, as text."""
    factors = [rng.randint(11, 99), rng.randint(11, 99)] + ([rng.randint(2, 9)] if rng.random() < 0.5 else [])
    return {"prompt": [{"role": "user", "content": "*".join(map(str, factors))}], "target": str(math.prod(factors))}


def demonstration(rng):
    """A row of sft.py's data for the built-in task, an episode of a sloppy demonstrator in TRL's format (`messages`
    with tool calls and tool turns, `tools`): a call on the first two factors, a call on that result and the next,
    then the product as the answer. It slips as sft.py's sort demonstrator does, so that RL has errors to unlearn:
    1 call in 10 cut short (its error, then the call again), 1 in 10 with a digit of a factor changed (a wrong
    product carried to the answer), and 1 episode in 10 answered without the tool (a guess)."""
    row = tool_task_row(rng)
    factors = [int(x) for x in row["prompt"][0]["content"].split("*")]
    messages = list(row["prompt"])
    if rng.random() < 0.1:  # a guess, as long as the product and wrong
        product = int(row["target"])
        messages.append({"role": "assistant", "content": str(product + rng.choice((-1, 1)) * rng.randint(1, 99))})
    else:
        result = factors[0]
        for factor in factors[1:]:
            if rng.random() < 0.1:  # a call cut short: the tool's error, then the call again
                cut = f'<tool_call>{{"name":"multiply","arguments":{{"a":{result},"b":{factor}}}</tool_call>'
                error, _ = call_tool({"multiply": multiply}, parse_calls(cut)[1][0], 1.0)
                messages += [{"role": "assistant", "content": cut},
                             {"role": "tool", "name": "multiply", "content": error}]
            a = int(str(result)[::-1]) if rng.random() < 0.1 and str(result)[0] != str(result)[-1] else result
            result = multiply(a, factor)
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": factor}}}]},
                {"role": "tool", "name": "multiply", "content": str(result)}]
        messages.append({"role": "assistant", "content": str(result)})
    return {"messages": messages, "tools": tool_schemas({"multiply": multiply})}


def write_demonstrations(path, seed, n=20_000):
    """--write-sft-data: n demonstrations of the built-in task (from a random stream of their own) to a .jsonl file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in task_rows(seed, "sft", n, demonstration))
    print(f"wrote {n:,} demonstrations of the built-in tool task to {path}")


@dataclass
class Environment:
    """What an episode runs in: the tokenizer and its chat template, the tools by name, their schemas, the stop ids."""
    tokenizer: object
    tools: dict
    schemas: list
    stop_ids: list
    said: set = field(default_factory=set)  # the notes printed (note_once)


@dataclass
class Episodes:
    """A rollout of B episodes, the G of each prompt in adjacent rows; token tensors are [B, the longest completion],
    a completion being every token after the prompt: the policy's turns and the environment's."""
    sequences: torch.Tensor  # prompt and completion token ids, [B, context_length + T]
    attention_mask: torch.Tensor  # 1 on every real token, the environment's too: the policy reads them
    context_length: int  # the prompts' padded width: completions start at this column
    mask: torch.Tensor  # 1.0 on the tokens the policy sampled (episode_tokens), 0 on the environment's and padding
    rewards: torch.Tensor  # [B]
    table: torch.Tensor  # [B, K]: each reward term, NaN where it does not apply
    has_stop: torch.Tensor  # [B]: the last turn ended with a stop token (it was not cut at the length limit)
    sampler_logprobs: torch.Tensor  # log π_sampler of each sampled token, as `generate` drew it; 0 elsewhere
    loss_mask: torch.Tensor  # the tokens the loss sees: `mask`, with --mask-truncated-completions not a cut episode's
    num_tokens: float  # dapo's and cispo's normalizer: the rollout's loss tokens per minibatch
    conversations: list  # each episode's messages after its prompt, as the reward functions receive them
    counts: torch.Tensor  # [B, 4]: tool calls, failed calls, turns of the policy, tokens of the environment


def run_episodes(policy, env, prompt_ids, prompts, args, greedy=False):
    """Each prompt's episode, all at once: sample a turn for every episode still going (`generate`, one batch),
    parse its calls, run them, append the tool turn's ids (tool_turn_ids) and go on, until a turn calls no tool, has
    no stop token (cut at --max-completion-length tokens after the prompt), or --max-tool-calling-iterations rounds
    are done. A tool turn that would leave no room for a next turn is dropped and its episode ends (TRL's rule), as does one the
    template cannot render so that it continues the sampled ids (refused, said once). Returns per episode its turns
    [(ids, sampled, logprobs)], its messages after the prompt, and its counts (calls, failures, turns, tool tokens)."""
    turns, conversations = [[] for _ in prompt_ids], [[] for _ in prompt_ids]
    counts = [[0, 0, 0, 0] for _ in prompt_ids]  # calls, failed calls, the policy's turns, the environment's tokens
    used, going, rounds = [0] * len(prompt_ids), list(range(len(prompt_ids))), 0  # used: tokens after the prompt
    while going:
        contexts = [prompt_ids[b] + [t for ids, _, _ in turns[b] for t in ids] for b in going]
        room = [args.max_completion_length - used[b] for b in going]
        sequences, _, width, response_mask, logprobs = generate(policy, contexts, env.tokenizer.pad_token_id,
                                                                env.stop_ids, max(room), args.temperature, greedy)
        still = []
        for row, b in enumerate(going):
            n = min(int(response_mask[row].sum()), room[row])  # a turn is cut at the episode's limit
            ids = sequences[row, width : width + n].tolist()
            turns[b].append((ids, True, logprobs[row, :n].tolist()))
            used[b], counts[b][2] = used[b] + n, counts[b][2] + 1
            message = parse_turn(env.tokenizer, ids)
            conversations[b].append(message)
            stopped = bool(ids) and ids[-1] in env.stop_ids
            if not stopped or not message["tool_calls"] or rounds == args.max_tool_calling_iterations:
                continue
            results = [call_tool(env.tools, call, args.tool_timeout) for call in message["tool_calls"]]
            counts[b][0] += len(results)
            counts[b][1] += sum(failed for _, failed in results)
            replies = [{"role": "tool", "name": call["function"]["name"], "content": content}
                       for call, (content, _) in zip(message["tool_calls"], results)]
            suffix = tool_turn_ids(env.tokenizer, prompts[b] + conversations[b], replies, env.schemas, env.stop_ids)
            if suffix is None:
                note_once(env, "refused", "note: a tool turn the chat template renders so that its ids cannot continue "
                          "the sampled ones was refused: its episode ends there (now and whenever this happens)")
            elif used[b] + len(suffix) < args.max_completion_length:  # TRL's rule: a result with no room ends it
                turns[b].append((suffix, False, None))
                conversations[b] += replies
                used[b], counts[b][3] = used[b] + len(suffix), counts[b][3] + len(suffix)
                still.append(b)
        going, rounds = still, rounds + 1
    return turns, conversations, counts


def note_once(env, key, line):
    """Print `line` the first time `key` happens in this run."""
    if key not in env.said:
        print(line)
        env.said.add(key)


def sample_episodes(policy, env, rows, prompt_ids, terms, args, greedy=False):
    """The episodes of `prompt_ids` (run_episodes) as the update's tensors (episode_tokens), and their rewards."""
    turns, conversations, counts = run_episodes(policy, env, prompt_ids, [row["prompt"] for row in rows], args, greedy)
    episodes = [episode_tokens(t) for t in turns]
    width, length, device = max(map(len, prompt_ids)), max(len(ids) for ids, _, _ in episodes), policy.device
    pad = env.tokenizer.pad_token_id
    sequences = torch.tensor([[pad] * (width - len(p)) + p + ids + [pad] * (length - len(ids))
                              for p, (ids, _, _) in zip(prompt_ids, episodes)], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(ids)) + [0] * (length - len(ids))
                                   for p, (ids, _, _) in zip(prompt_ids, episodes)], device=device)
    mask, sampler_logprobs = (torch.tensor([e[k] + [0.0] * (length - len(e[k])) for e in episodes], device=device)
                              for k in (1, 2))
    has_stop = torch.tensor([bool(t[-1][0]) and t[-1][0][-1] in env.stop_ids for t in turns], device=device)
    rewards, table = episode_rewards(rows, conversations, has_stop, terms, args)
    loss_mask = mask * has_stop.unsqueeze(1) if args.mask_truncated_completions else mask
    num_tokens = max(1.0, loss_mask.sum().item()) * args.mini_batch_size / len(rows)  # each token weighs the same
    return Episodes(sequences, attention_mask, width, mask, rewards, table, has_stop, sampler_logprobs, loss_mask,
                    num_tokens, conversations, torch.tensor(counts, dtype=torch.float))


def episode_rewards(rows, conversations, has_stop, terms, args):
    """The reward of each episode, r = Σ_k w_k r_k over the reward functions (combine_rewards), each given the
    prompts and the episodes' messages after them (TRL's completions of a tool run: the answer is the last message),
    or --missing-eos-penalty for an episode cut at the length limit. Returns (rewards, the [B, K] table)."""
    table = reward_terms(terms.functions, [row["prompt"] for row in rows], conversations, reward_columns(rows))
    rewards = combine_rewards(table.to(has_stop.device), terms.weights)
    return torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty)), table


def episode_text(tokenizer, sequence, attention_mask, mask, context_length):
    """An episode as text with its mask: the prompt, then the completion's tokens, the environment's (m = 0) between
    ⟦ ⟧ and the policy's (m = 1) as they are, special tokens shown."""
    ids, real, mask = sequence.tolist(), attention_mask.tolist(), [0.0] * context_length + mask.tolist()
    pieces, start = [tokenizer.decode([t for t, r in zip(ids[:context_length], real) if r])], context_length
    for end in range(context_length + 1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start] or not real[end]:
            text = tokenizer.decode(ids[start:end])
            pieces.append(text if mask[start] else f"⟦{text}⟧")
            start = end
            if end < len(ids) and not real[end]:
                break
    return "".join(pieces)


def log_agent_iteration(writer, iteration, batch, old, stats, names, lr, start_time, control, args):
    """An iteration's statistics of the whole batch, to TensorBoard (docs/tags.md), and a line every 10 iterations:
    the policy's tokens only (entropy, lengths, clipping, KL) and the tools' apart."""
    B, G, mask, mismatch = args.batch_size, args.num_generations, batch.mask, old.mismatch
    groups, tokens = batch.rewards.view(-1, G), mask.sum().item()
    num_minibatches = args.ppo_epochs * B // args.mini_batch_size
    calls, failures, turns, tool_tokens = batch.counts.sum(0).tolist()
    logs = {
        "objective/reward": batch.rewards.nansum().item() / max(1, int((~batch.rewards.isnan()).sum())),
        "objective/reward_std": groups.std(1).nansum().item() / (B // G),
        "objective/zero_std_fraction": (groups.std(1) == 0).sum().item() / (B // G),
        "objective/completion_length": tokens / B, "objective/entropy": (old.entropy * mask).sum().item() / B,
        "objective/stop_fraction": batch.has_stop.sum().item() / B,
        "tools/call_count": calls / B, "tools/failure_count": failures / B, "tools/turns": turns / B,
        "tools/tool_tokens": tool_tokens / B,
        "losses/policy_loss": stats["policy_loss"] / num_minibatches,
        "policy/clipfrac": (stats["clipped_low"] + stats["clipped_high"]) / (args.ppo_epochs * tokens),
        "policy/first_ratio_max_error": stats["first_ratio_max_error"],
        "policy/entropy": stats["policy_entropy"] / (args.ppo_epochs * max(1.0, batch.loss_mask.sum().item())),
        "charts/learning_rate": lr, "charts/episodes_per_second": iteration * B / (time.time() - start_time),
        "rollout/logprob_diff_mean": mismatch[0].item() / tokens, "rollout/logprob_diff_max": mismatch[1].item(),
    }
    for name, on in (("dppo_masked", args.loss_type == "dppo"), ("cov_selected", args.cov_method is not None)):
        if on:  # as grpo.py's: the tokens out of DPPO's trust region; Clip-Cov's or KL-Cov's tokens
            logs[f"policy/{name}_fraction"] = stats[name] / (args.ppo_epochs * tokens)
    if control.on:
        logs.update({"policy/entropy_coef": control.coef, "losses/entropy_bonus": stats["bonus"] / num_minibatches})
    if args.beta > 0:
        logs.update({"objective/kl": old.k1.sum().item() / B,
                     "losses/kl_penalty": stats["kl_penalty"] / num_minibatches})
    logs.update(term_means(batch.table, names, "rewards/", "objective/score"))
    for tag, value in logs.items():
        writer.add_scalar(tag, float(value), iteration)
    if iteration % 10 == 0:
        print(f"iteration {iteration}: reward {logs['objective/reward']:.3f}, calls {logs['tools/call_count']:.2f} "
              f"(failed {logs['tools/failure_count']:.2f}) per episode, kl {logs.get('objective/kl', 0.0):.3f}, "
              f"{time.time() - start_time:.0f} s")


@torch.no_grad()
def evaluate(policy, env, eval_rows, eval_ids, terms, amp, writer, iteration, args):
    """Episodes of the eval prompts, sampled at --temperature and greedy: their reward, calls and failures per
    episode and, on the built-in task, the gold accuracy (the answer is the product). The first episodes go to
    TensorBoard as text with their masks; the first one is printed at the start and at the end."""
    if not eval_ids:
        return
    policy.eval()
    logs = {}
    for suffix, greedy in (("", False), ("_greedy", True)):
        with amp():
            batch = sample_episodes(policy, env, eval_rows, eval_ids, terms, args, greedy)
        if not greedy:
            logs["eval/reward"] = float(batch.rewards.nanmean())
            logs["eval/call_count"], logs["eval/failure_count"] = (float(c) for c in batch.counts[:, :2].mean(0))
            texts = [episode_text(env.tokenizer, *(t[i] for t in (batch.sequences, batch.attention_mask, batch.mask)),
                                  batch.context_length) for i in range(min(4, len(eval_ids)))]
        if args.dataset_name is None:  # the built-in task: the answer is exactly the product
            targets = [row["target"] for row in eval_rows]
            logs[f"eval/gold_accuracy{suffix}"] = sum(exact_match(None, batch.conversations, targets)) / len(targets)
    for tag, value in logs.items():
        writer.add_scalar(tag, value, iteration)
    writer.add_text("eval/episodes", "\n\n".join(f"    {t!r}" for t in texts), iteration)
    print(f"iteration {iteration}: " + ", ".join(f"{tag} {value:.3f}" for tag, value in logs.items()))
    if iteration in (0, args.num_iterations):
        print(f"an episode (⟦the environment's tokens⟧, m = 0; the rest the policy's, m = 1):\n    {texts[0]!r}")
    policy.train()


def tokenize_tool_prompts(tokenizer, rows, schemas, max_prompt_length, split):
    """(rows, token ids of their prompts with the tools' schemas, ending with the assistant's header) of the rows
    whose prompt fits `max_prompt_length`; the others are dropped and counted. A text prompt is one user turn."""
    for row in rows:
        if not isinstance(row["prompt"], list):
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    encoded = [render_chat(tokenizer, row["prompt"], add_generation_prompt=True, tools=schemas) for row in rows]
    kept = [i for i, ids in enumerate(encoded) if len(ids) <= max_prompt_length]
    if len(kept) < len(encoded):
        print(f"{split}: dropped {len(encoded) - len(kept):,} of {len(encoded):,} prompts longer than "
              f"--max-prompt-length {max_prompt_length} (the longest: {max(map(len, encoded)):,} tokens)")
    return [rows[i] for i in kept], [encoded[i] for i in kept]


def load_models(args, device):
    """(tokenizer, stop_ids, policy, reference or None), on the device: the policy in float32, the reference as the
    policy (before the first update the KL is exactly 0), dropout off in both; the reference only when β > 0."""
    tokenizer = load_tokenizer(args.model_name_or_path, "run `python agent_grpo.py --write-sft-data data/tools.jsonl` "
                               "and sft.py on it first (docs/agent_grpo.md), or pass a path")
    stop_ids = stop_token_ids(tokenizer)
    policy = load_no_dropout(args.model_name_or_path, "lm")
    ref = load_no_dropout(args.model_name_or_path, "lm") if args.beta > 0 else None
    prepare_models(tokenizer, stop_ids, [m for m in (policy, ref) if m is not None], [ref] if ref is not None else [])
    return tokenizer, stop_ids, policy.to(device), ref.to(device) if ref is not None else None


@dataclass
class RewardTerms:
    """What a completion's reward is made of: the reward functions (name, fn) and the reward model (or None),
    their weights, and the name of each term (the reward model's "reward_model")."""
    functions: list
    weights: tuple
    reward: torch.nn.Module | None
    names: list


@dataclass
class OldPolicy:
    """π_old on the rollout, the policy the update starts from; token tensors are [B, response_length]."""
    logprobs: torch.Tensor  # log π_old of each completion token
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None  # log π_ref; None when β = 0 (no reference)
    k1: torch.Tensor | None  # the KL estimators to π_ref (kl_estimators); None when β = 0
    k3: torch.Tensor | None
    mismatch: tuple  # the sampler's distance from π_old (sampler_mismatch)
    is_weights: torch.Tensor | None  # the sampler correction's weights (sampler_correction); None without it


def old_policy(policy, ref, batch, logprobs_of, args):
    """π_old's and π_ref's log-probs of the rollout's tokens, the KL between them (none when β = 0), and the
    sampler's distance from π_old with the weights that correct for it."""
    logprobs, entropy = logprobs_of(policy, batch.sequences, batch.attention_mask, batch.context_length)
    ref_logprobs = k1 = k3 = None
    if args.beta > 0:
        ref_logprobs, _ = logprobs_of(ref, batch.sequences, batch.attention_mask, batch.context_length)
        k1, k3 = kl_estimators(logprobs, ref_logprobs, batch.mask)
    return OldPolicy(logprobs, entropy, ref_logprobs, k1, k3,
                     *sampler_correction(logprobs, batch.sampler_logprobs, batch.mask, args))


def sampler_correction(old_logprobs, sampler_logprobs, mask, args):
    """How far the sampler is from π_old (sampler_mismatch, for the rollout/ tags) and, with
    --vllm-importance-sampling-correction, the weight of each token that corrects for it
    (sampler_importance_weights; None without)."""
    mismatch = sampler_mismatch(old_logprobs, sampler_logprobs, mask, args.vllm_importance_sampling_clip_max or 3.0)
    if not args.vllm_importance_sampling_correction:
        return mismatch, None
    return mismatch, sampler_importance_weights(old_logprobs, sampler_logprobs, mask,
                                                args.vllm_importance_sampling_mode,
                                                args.vllm_importance_sampling_clip_min,
                                                args.vllm_importance_sampling_clip_max)


def grpo_token_losses(ratio, logprobs, entropy, advantages, batch, old, mb, epsilon_high, args):
    """Each token's loss of minibatch `mb` (token_losses; vespo's weight from vespo_weights), with --loss-type dppo
    the tokens out of the trust region dropped (dppo_trust_region), with --cov-method the Clip-Cov or KL-Cov tokens
    detached or penalized (token_covariance), weighed by the sampler correction (the sampler was not π_old:
    π_old / π_sampler; vespo's weight has it), with --off-policy-mask-threshold the negative completions the policy
    left behind dropped (off_policy_sequence_mask), and with --top-entropy-quantile only the high-entropy tokens
    kept (high_entropy_mask). Returns (the losses, counts for the logs: completions and tokens dropped, tokens
    chosen by the Cov method, the entropy summed over the loss's tokens)."""
    mask, loss_mask, a = batch.mask[mb], batch.loss_mask[mb], args
    is_weights = None if old.is_weights is None else old.is_weights[mb]
    weights = (vespo_weights(logprobs - old.logprobs[mb], mask, advantages, is_weights, a.vespo_k_pos,
                             a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg) if a.loss_type == "vespo" else None)
    losses = token_losses(ratio, logprobs, advantages, a.loss_type, a.epsilon, epsilon_high, weights,
                          (a.sapo_temperature_pos, a.sapo_temperature_neg))
    zero = torch.zeros((), device=losses.device)
    counts = {"off_policy_masked": zero, "dppo_masked": zero, "cov_selected": zero,
              "policy_entropy": (entropy.detach() * loss_mask).sum()}
    keep = torch.ones_like(losses)
    if a.loss_type == "dppo":
        keep = dppo_trust_region(logprobs, batch.sampler_logprobs[mb], advantages, a.dppo_divergence, a.epsilon,
                                 epsilon_high)
        losses, counts["dppo_masked"] = losses * keep, ((1 - keep) * mask).sum()
    if a.cov_method == "clip_cov":  # among the tokens the loss does not already cut (the clip, DPPO's mask)
        low, high = clipped_tokens(ratio, advantages, a.epsilon, epsilon_high, a.loss_type)
        chosen = clip_cov_tokens(token_covariance(advantages, logprobs, loss_mask), loss_mask, low | high | (keep == 0),
                                 a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub)
        losses, counts["cov_selected"] = losses * ~chosen, chosen.sum()
    elif a.cov_method == "kl_cov":
        chosen = kl_cov_tokens(token_covariance(advantages, logprobs, loss_mask), loss_mask, a.kl_cov_ratio)
        losses = losses + a.kl_cov_coef * (logprobs - old.logprobs[mb]).abs() * chosen
        counts["cov_selected"] = chosen.sum()
    if is_weights is not None and a.loss_type != "vespo":
        losses = losses * is_weights
    if a.off_policy_mask_threshold is not None:
        kept = off_policy_sequence_mask(advantages, logprobs, batch.sampler_logprobs[mb], mask,
                                        a.off_policy_mask_threshold)
        losses, counts["off_policy_masked"] = losses * kept, (1 - kept).sum()
    if a.top_entropy_quantile < 1:
        losses = losses * high_entropy_mask(entropy, loss_mask, a.top_entropy_quantile)
    return losses, counts


class EntropyControl:
    """--entropy-coef and --use-adaptive-entropy: the bonus c·H̄ the loss subtracts (entropy_bonus), over the tokens
    the policy loss sees (with --top-entropy-quantile, the high-entropy ones, as TRL), and with adaptive control its
    coefficient moved after each optimizer step, here each minibatch (adaptive_entropy_coef; TRL applies no bonus
    before the first measurement). Off (the defaults): no bonus, and the update's entropy carries no gradient."""

    def __init__(self, args):
        self.args, self.coef, self.last = args, args.entropy_coef, math.inf
        self.on = args.entropy_coef != 0 or args.use_adaptive_entropy

    def bonus(self, entropy, loss_mask, counts):
        """c·H̄ of a minibatch (into `counts` for the logs); then the coefficient moves by this minibatch's H̄."""
        if not self.on:
            return torch.zeros((), device=loss_mask.device)
        a = self.args
        mask = loss_mask * high_entropy_mask(entropy, loss_mask, a.top_entropy_quantile) if a.top_entropy_quantile < 1 \
            else loss_mask
        mean = entropy_bonus(entropy, mask)
        coef = self.coef if not a.use_adaptive_entropy or self.last <= a.entropy_target else 0.0
        counts["bonus"] = coef * mean.detach()
        if a.use_adaptive_entropy:
            self.last = mean.item()
            self.coef = adaptive_entropy_coef(self.coef, self.last, a.entropy_target, a.entropy_coef_delta,
                                              a.entropy_coef_min, a.entropy_coef_max)
        return coef * mean


def kl_to_reference(logprobs, ref_logprobs, loss_mask, mb, num_tokens, max_completion_length, args):
    """The KL penalty of minibatch `mb`, β · D_KL[π_θ ‖ π_ref] with k3 per token, aggregated as the policy loss
    (TRL's, with the same normalizers: N = `num_tokens`, L_max = `max_completion_length`); 0 when β = 0."""
    if args.beta == 0:
        return torch.zeros((), device=logprobs.device)
    _, k3 = kl_estimators(logprobs, ref_logprobs[mb], loss_mask[mb])
    return args.beta * aggregate_loss(k3, loss_mask[mb], args.loss_type, args.mini_batch_size, num_tokens,
                                      max_completion_length)


@torch.no_grad()
def accumulate_grpo_stats(stats, policy_loss, kl_penalty, ratio, advantages, mask, counts, first, epsilon_high, args):
    """Adds a minibatch's losses, clipped-token counts and grpo_token_losses' counts to `stats`; at the first
    minibatch of an iteration, before any step, the ratio's largest distance from 1 (it must be exactly 0)."""
    stats["policy_loss"] += policy_loss.item()
    stats["kl_penalty"] += kl_penalty.item()
    low, high = clipped_tokens(ratio, advantages, args.epsilon, epsilon_high, args.loss_type)
    stats["clipped_low"] += (low * mask).sum().item()
    stats["clipped_high"] += (high * mask).sum().item()
    for name in ("off_policy_masked", "dppo_masked", "cov_selected", "policy_entropy", "bonus"):
        stats[name] += float(counts.get(name, 0.0))
    if first:
        stats["first_ratio_max_error"] = (ratio - 1).abs().max()


def term_means(table, names, prefix, score_tag):
    """{tag: mean} of each reward term over the completions it applies to (where its value is not NaN), tagged
    prefix + its name, the reward model's `score_tag`; a term that applies to none is left out."""
    return {score_tag if name == "reward_model" else prefix + name:
            float(table[:, k].nan_to_num().sum()) / float((~table[:, k].isnan()).sum())
            for k, name in enumerate(names) if not table[:, k].isnan().all()}


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
                         f"{', '.join(f'`{c}`' for c in needed)} column (the answer), which it lacks (its columns: "
                         f"{sorted(columns)}); add it, or pass a reward function of yours (--reward-fn FILE.py:NAME)")
            sys.exit(f"error: reward function {name!r} cannot be called as {name}({', '.join(keywords)}): {e}; write "
                     f"it as def {name}(prompts, completions, **columns) (the dataset's columns: {sorted(columns)})")


def reward_columns(rows):
    """What reward functions receive of these rows as **columns: every column of the data but `prompt`, by name."""
    return {name: [row[name] for row in rows] for name in rows[0] if name != "prompt"} if rows else {}


def reward_terms(functions, prompts, completions, columns):
    """[B, K] float32: reward function k on completion i, NaN where it returned None ("does not apply"). A
    function that raises, or returns a value that is not a finite number or None, or not one value per
    completion, stops the run with one line naming it; nothing is saved."""
    table = torch.full((len(completions), len(functions)), float("nan"))
    for k, (name, fn) in enumerate(functions):
        try:
            values = list(fn(prompts=prompts, completions=completions, **columns))
        except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
            sys.exit(f"error: reward function {name!r} raised {type(e).__name__}: {first_line(e)}; stopped, nothing saved")
        if len(values) != len(completions):
            sys.exit(f"error: reward function {name!r} returned {len(values)} values for {len(completions)} completions")
        bad = [v for v in values if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))]
        if bad:
            sys.exit(f"error: reward function {name!r} returned {bad[0]!r} (a finite number or None is needed); "
                     "stopped, nothing saved")
        table[:, k] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    return table


# ---------------------------------------------------------------------------------------------
# Forward passes and sampling
# ---------------------------------------------------------------------------------------------
def position_ids_of(attention_mask):
    """Positions count real tokens only, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def policy_logprobs(model, sequences, attention_mask, context_length, temperature, entropy_grad=False):
    """(log π(a_t | s_t) of each response token, the entropy of π(·|s_t)), from one forward pass over prompt +
    response: z = logits / temperature in float32, as `generate` draws tokens, log π = log_softmax(z)."""
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_of(attention_mask), use_cache=False).logits[:, context_length - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, -1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # for an entropy bonus only
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, sequences[:, context_length:].unsqueeze(-1)).squeeze(-1), entropy


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


# ---------------------------------------------------------------------------------------------
# Training and saving
# ---------------------------------------------------------------------------------------------
def settle_defaults(args):
    """The defaults that depend on the run, settled before the argument checks (and logged as settled). --bf16: on
    where CUDA has bfloat16, as in TRL's configs; on the CPU float32 is faster. --vllm-importance-sampling-correction
    (the RL scripts): TRL corrects by default; here only a stale sampler (--rollout-lag) needs it. rlhf_ppo's
    --critic-lam and --actor-lam: --lam (the actor's stays unset under --length-adaptive-lam)."""
    if args.bf16 is None:
        args.bf16 = args.cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if getattr(args, "vllm_importance_sampling_correction", False) is None:
        args.vllm_importance_sampling_correction = args.rollout_lag > 0
    if getattr(args, "no_scale_rewards", False):  # grpo: --no-scale-rewards, the older --scale-rewards none
        args.scale_rewards = "none"
    if getattr(args, "critic_lam", 0) is None:
        args.critic_lam = args.lam
    if getattr(args, "actor_lam", 0) is None and args.length_adaptive_lam is None:
        args.actor_lam = args.lam


class RolloutLag:
    """--rollout-lag K: the policy's weights of the last K iterations, oldest first, as an asynchronous trainer's
    sampler lags behind it. `with lag:` samples with the oldest (in the first K iterations, the start's), then puts
    the current weights back and keeps them as the newest, in the oldest's memory. K = 0: nothing happens. It says
    at the start the lag and its correction. (With LoRA only the adapters change; under FSDP each rank keeps its
    shards.)"""

    def __init__(self, model, args):
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.lagged = [[p.detach().clone() for p in self.trained] for _ in range(args.rollout_lag)]
        if args.rollout_lag or args.vllm_importance_sampling_correction:  # said at the start, as the run's setting
            bounds = (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
            print(f"note: --rollout-lag {args.rollout_lag}, " + (
                f"corrected by --vllm-importance-sampling-mode {args.vllm_importance_sampling_mode} (bounds {bounds})"
                if args.vllm_importance_sampling_correction else "no correction (--vllm-importance-sampling-correction)"))

    def __enter__(self):
        if self.lagged:
            swap_weights(self.trained, self.lagged[0])

    @torch.no_grad()
    def __exit__(self, *exception):
        if self.lagged:
            swap_weights(self.trained, self.lagged[0])
            self.lagged.append(self.lagged.pop(0))
            for p, w in zip(self.trained, self.lagged[-1]):
                w.copy_(p)


@torch.no_grad()
def swap_weights(parameters, weights):
    """Exchange each of `parameters` with its tensor of `weights` in place, one temporary copy at a time: the
    sampler of --rollout-lag is the policy holding older weights (the copy keeps each tensor where it is)."""
    for p, w in zip(parameters, weights):
        current = p.clone()
        p.copy_(w)
        w.copy_(current)


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
