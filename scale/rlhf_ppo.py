"""RLHF stage 2: PPO on a language model with the four models of RLHF.

Ouyang et al. 2022 (InstructGPT) and Ziegler et al. 2019, with the details of Huang et al. 2024,
"The N+ implementation details of RLHF with PPO":
- actor      π_θ     trained, starts as the SFT model (models/sft)
- reference  π_ref   frozen copy of the SFT model: the KL penalty keeps π_θ near it
- reward     r_φ     frozen reward model (models/reward_model), scores a whole response at its stop token
- critic     V_ψ     trained, starts as the reward model; its scalar head gives one value per token
Each token is an action; the per-token reward is −β·(log π_θ − log π_ref), plus the score at the last
response token. GAE over the response, then several epochs of clipped PPO updates per rollout. The score
is r_φ's, or rule-based rewards (plain Python functions, --reward-fn) instead of or added to it: without
a reward model, three models are in memory and the critic starts from the SFT model.

    python sft.py && python reward_model.py && python scale/rlhf_ppo.py    # built-in task, CPU
    python scale/rlhf_ppo.py --kl-coef 0                                   # what the KL penalty is for
    python scale/rlhf_ppo.py --reward-fn gold --reward-model-path None     # the gold score, no reward model
    python scale/rlhf_ppo.py --model-name-or-path my-sft --reward-model-path my-rm --dataset-name data.jsonl --lr 1e-6

The full program. Take it instead of the top-level rlhf_ppo.py, the one-device reference, for torchrun (DDP, FSDP2),
LoRA, gradient accumulation and checkpointing, or checkpoints that resume exactly; on one process it computes what
rlhf_ppo.py computes (tests/test_tiers.py). On one GPU it samples with the token step replayed as a CUDA graph
(`sample_tokens_graphed`; its speed against the eager loop and TRL: docs/scaling.md).
"""
import collections
import ctypes
import datetime
import decimal
import functools
import gc
import importlib.util
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
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
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
    """seed of python, torch and the built-in task's prompts"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    threads: int | None = None
    """torch CPU threads (default: OMP_NUM_THREADS where set, else one fewer than the cores, at least 1: a thread
    that waits for a core stalls the others at every step, so leaving a core free keeps a run's speed on a busy
    machine; README's quickstart has the figures)"""
    progress: bool = True
    """on a terminal, a line every ~10 s: the steps done, their rate, the time left and the batch's mean score
    (--no-progress: none)"""
    model_name_or_path: Annotated[str, tyro.conf.arg(aliases=("--sft-model-path",))] = "models/sft"
    """the SFT model, hub id or local directory: the actor's start and the frozen reference (made by sft.py; TRL:
    model_name_or_path; --sft-model-path, its old name here, works in this release)"""
    reward_model_path: str | None = "models/reward_model"
    """the frozen reward model, also the critic's start (reward_model.py's output); None: no reward model, the
    reward is --reward-fn's (three models in memory; the critic starts from the SFT model)"""
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a rule-based reward, repeatable, instead of or added to the reward model's score (the score is the weighted
    sum): a built-in, gold (the built-in task's gold score), exact_match, numeric_match or format (see below), or
    MODULE_OR_FILE:NAME of your own, fn(prompts, completions, **columns) -> list[float | None]"""
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
    dataset_name: str | None = None
    """prompts: hub id, local dataset directory, or .json/.jsonl/.parquet file with a `prompt` column (text or
    conversational); its other columns (a `target`) reach the reward functions by name; None: built-in task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to draw prompts from"""
    system_prompt: str | None = None
    """a system message put first in every conversation of the data that has none (conversational data only)"""
    output_dir: str = "models/rlhf_ppo"
    """where the trained policy is saved as a Hugging Face checkpoint (atomically)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    num_iterations: int = 80
    """rollout-then-update iterations (CleanRL: --total-timesteps / batch; TRL: total_episodes / batch_size)"""
    batch_size: int = 128
    """prompts (and sampled responses) per rollout, over all ranks: each of N ranks (torchrun) samples batch_size / N"""
    mini_batch_size: int = 32
    """responses per gradient step, over all ranks (each rank's share: mini_batch_size / N); CleanRL and TRL set the
    count instead, num_minibatches / num_mini_batches = batch_size / mini_batch_size"""
    gradient_accumulation_steps: int = 1
    """split each rank's share of a minibatch into this many micro-batches (the same update, less memory); the
    rollout's forward passes run in micro-batches too, so that the first ratio stays exactly 1"""
    gradient_checkpointing: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on under --fsdp, else off) recompute activations in the backward pass of the actor and critic (less
    memory, one more forward pass of compute)"""
    compile: bool = False
    """torch.compile each transformer block of the actor and the critic for the passes that compute gradients
    (fewer, fused kernels; the first steps pay the compile time; docs/scaling.md measures it)"""
    generation_batch_size: int = 128
    """prompts per sampling call, on each rank (the KV cache grows with it; forward passes run in micro-batches)"""
    ppo_epochs: int = 4
    """passes over each rollout (CleanRL: update_epochs; TRL: num_ppo_epochs)"""
    lr: float = 1.5e-4
    """AdamW learning rate of the actor and the critic (CleanRL, TRL: learning_rate)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over the iterations (the late updates then settle)"""
    response_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """new tokens sampled per response (default: 12 on the built-in task; on a dataset, TRL's max_completion_length
    512, cut to what the model's positions leave)"""
    max_prompt_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """prompts longer than this many tokens are dropped (and counted) (default: 64 on the built-in task, 512 on a
    dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast; FSDP2's
    MixedPrecisionPolicy under --fsdp), the trained weights and AdamW state float32. The reference is held and computed
    exactly as the actor (before the first update the KL is exactly 0); the reward model is held in bfloat16; values and
    scores are float32"""
    fsdp: bool = False
    """under torchrun, shard the actor and critic, their gradients and AdamW state, and the frozen models, across the
    ranks (FSDP2) instead of a full copy on each (DDP): for models that do not fit one device"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training divide the logits by it too"""
    kl_coef: float = 1.0
    """β of the per-token KL penalty (the start value when --kl-target is set); 1.0 because on the built-in task a
    smaller β lets PPO exploit the reward model's mistakes (TRL's 0.05: gold accuracy up to 62%, then down to 46%)"""
    kl_target: float | None = None
    """adapt β toward this KL per sequence with the proportional controller of Ziegler et al. 2019"""
    kl_horizon: int = 10_000
    """horizon of the adaptive controller, in sampled responses"""
    missing_eos_penalty: float = -3.0
    """the score of a response with no stop token (EOS or end of turn) in its --response-length tokens"""
    gamma: float = 1.0
    """discount over response tokens"""
    lam: float = 0.95
    """λ of GAE (CleanRL: gae_lambda): the critic's and the actor's, unless --critic-lam or --actor-lam"""
    critic_lam: float | None = None
    """λ of the critic's GAE targets (decoupled GAE, VC-PPO and VAPO: 1.0, Monte Carlo returns); default --lam"""
    actor_lam: float | None = None
    """λ of the actor's GAE advantages (VC-PPO and VAPO: 0.95); default --lam"""
    length_adaptive_lam: float | None = None
    """α of VAPO's length-adaptive GAE: the actor's λ = 1 − 1/(α·l) for a response of l tokens (VAPO: 0.05, for
    responses of thousands of tokens), instead of --actor-lam"""
    value_warmup_steps: int = 0
    """value pretraining (VC-PPO): this many rollouts of the starting policy train the critic alone, towards λ = 1
    (Monte Carlo) targets, before the actor's first update"""
    cliprange: float = 0.2
    """ε of the clipped policy loss (CleanRL: clip_coef); the lower clip, 1 − ε, with --cliprange-high"""
    cliprange_high: float | None = None
    """ε_high, the upper clip 1 + ε_high (clip-higher, DAPO and VAPO: 0.28); default --cliprange"""
    positive_lm_coef: float = 0.0
    """μ of VAPO's positive-example LM loss: μ × the NLL of the responses that pass (exactly the target on the
    built-in task, every reward function ≥ 1 otherwise) is added to the policy loss (VAPO: 0.1); 0: off"""
    cliprange_value: float = 0.2
    """ε of the clipped value loss (CleanRL: clip_coef, the same ε as the policy's)"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    rollout_lag: int = 0
    """K: sample each rollout with the actor's weights of K iterations before, as an asynchronous trainer with a
    queue of K rollouts does; the update's ratio stays π_θ/π_old, π_old the current actor's log-probs (decoupled
    PPO), and the correction below weighs each token by π_old/π_sampler. Memory: K more copies of the actor's
    weights. 0: on-policy"""
    vllm_importance_sampling_correction: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on when --rollout-lag > 0, off at 0, where the sampler is the actor) weigh each token's loss by
    the sampler's importance weight (sampler_importance_weights); TRL's name, for completions from vLLM there"""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """token_truncate (TIS), token_mask (MIS), sequence_truncate or sequence_mask (TRL's default): see
    sampler_importance_weights"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """C_max: the weight's upper bound (truncate: clipped to it; mask: above it, 0); None: none (TRL's 3.0)"""
    vllm_importance_sampling_clip_min: float | None = None
    """C_min: the weight's lower bound (truncate: clipped to it; mask: below it, 0); None: none (TRL's)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (actor and critic together) to this"""
    eval_every: int = 20
    """evaluate every this many iterations (and before the first and after the last)"""
    eval_size: int = 512
    """eval prompts, 0 for no evaluation: the built-in task's come from their own random stream; a dataset's are its
    `test` split, or else prompts held out from the training ones"""
    eval_num_samples: int = 1
    """n: responses sampled per eval prompt; above 1, eval/pass@k for k = 1, 2, 4, ... up to n, unbiased (Chen et
    al. 2021), on the built-in task (the target exactly) and with reward functions (each one that applies scores 1)"""
    log_completions_every: int = 0
    """every this many iterations, a table of the rollout's first prompts, responses and reward terms under
    train/completions in TensorBoard's text tab (rank 0's); 0: never (TRL: log_completions)"""

    save_every: int = 0
    """write a checkpoint to resume from every this many iterations, to runs/<run>/checkpoint-<iteration> (0: none;
    SIGTERM always writes one, then ends the run)"""
    keep_checkpoints: int = 2
    """keep the last this many checkpoints, deleting older ones"""
    resume: str | None = None
    """resume from this checkpoint-<iteration> directory, or from the latest in this runs/<run> directory; the other
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
# The math: pure functions over [batch, response_length] tensors, `mask` 1 on response tokens up to
# and including the first stop token. Checked against hand-computed values in tests/test_rlhf_ppo.py.
# ---------------------------------------------------------------------------------------------
def masked_mean(x, mask, num_tokens=None):
    """Σ x·mask / N, N the number of valid tokens (or `num_tokens`: those of the whole minibatch when it is
    split into micro-batches, so that the micro-batches' losses add up to the minibatch's)."""
    return (x * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)


def masked_whiten(x, mask, eps=1e-8):
    """rlhf_ppo.py's masked_whiten over the valid tokens of all ranks: (x − mean) / std, padding 0, with the sums
    in mean = Σ x·m / Σ m and var = Σ (x − mean)²·m / Σ m added up over the ranks (on one process, the same)."""
    sums = torch.stack([(x * mask).sum(), mask.sum()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    count = sums[1].clamp(min=1)  # no valid token (none scored): all 0
    mean = sums[0] / count
    square_sum = ((x - mean) ** 2 * mask).sum()
    if dist.is_initialized():
        dist.all_reduce(square_sum)
    return (x - mean) * torch.rsqrt(square_sum / count + eps) * mask


def kl_estimators(logprobs, ref_logprobs, mask):
    """Per-token estimators of KL[π_θ ‖ π_ref] on tokens sampled from π_θ (Schulman 2020, "Approximating
    KL divergence"), with log r = log π_ref − log π_θ:
        k1 = −log r = log π_θ − log π_ref          (unbiased, can be negative per token)
        k3 = (r − 1) − log r                        (unbiased, never negative)
    Returns (k1, k3), zero on padding."""
    log_r = ref_logprobs - logprobs
    return -log_r * mask, (log_r.exp() - 1 - log_r) * mask


def shaped_rewards(logprobs, ref_logprobs, scores, mask, kl_coef):
    """The per-token reward of RLHF (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022):

        r_t = −β (log π_θ(a_t|s_t) − log π_ref(a_t|s_t))   + score · [t = last response token]

    The score is the reward model's on the whole response, given at its last token (its stop token); the
    tokens after it are padding and get 0. Returns (rewards, non_score_rewards)."""
    non_score = -kl_coef * (logprobs - ref_logprobs) * mask
    last = mask.sum(1).long() - 1
    rewards = non_score.clone()
    rewards[torch.arange(len(rewards)), last] += scores
    return rewards, non_score


def masked_gae(rewards, values, mask, gamma, lam):
    """GAE backwards over response tokens (PPO eq. 11-12), the episode ending at the last valid token:

        δ_t = r_t + γ V(s_{t+1}) − V(s_t),   with V = 0 after the last valid token
        Â_t = δ_t + γλ Â_{t+1}
    λ a number, or one per response ([B]). Padding has reward and value 0, so it contributes nothing. Returns
    (advantages, returns = Â + V)."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros(len(rewards), device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages[:, t] = lastgaelam
    advantages = advantages * mask
    return advantages, advantages + values


def decoupled_gae(rewards, values, mask, gamma, actor_lam, critic_lam):
    """Decoupled GAE (VC-PPO, arXiv 2503.01491, section 4.2; VAPO eq. 5): the policy's advantages and the critic's
    targets from GAE with a λ each,

        Â_t = GAE_{λ_actor}(r, V)_t,        R_t = GAE_{λ_critic}(r, V)_t + V(s_t)

    With λ_critic = 1, R_t = Σ_{t' ≥ t} γ^{t'−t} r_{t'}, the Monte Carlo return: the critic's target carries no bias
    of the critic's own; a smaller λ_actor trades that bias for lower variance in the policy gradient. `actor_lam`
    a number or one per response ([B], length_adaptive_lam). One pass where the two are the same number."""
    advantages, returns = masked_gae(rewards, values, mask, gamma, actor_lam)
    if isinstance(actor_lam, torch.Tensor) or actor_lam != critic_lam:
        returns = masked_gae(rewards, values, mask, gamma, critic_lam)[1]
    return advantages, returns


def length_adaptive_lam(mask, alpha):
    """VAPO's length-adaptive λ for the policy's GAE (arXiv 2504.05118, eq. 7), one per response of l tokens:

        λ_actor = 1 − 1 / (α l),   so that Σ_t λ^t = 1 / (1 − λ) = α l

    the weights on a token's future TD errors sum to a number proportional to the length, where a fixed λ gives
    a long response's early tokens almost none of its end. 0 where α l ≤ 1 (a response too short for α)."""
    return (1 - 1 / (alpha * mask.sum(1).clamp(min=1))).clamp(min=0)


def positive_lm_loss(logprobs, mask, positive, num_tokens=None):
    """VAPO's positive-example LM loss (arXiv 2504.05118, eq. 8): the NLL of the responses in T, those that pass,
    averaged over their tokens, and added to the policy loss as L_PPO + μ L_NLL:

        L_NLL = − 1 / Σ_{o_i ∈ T} |o_i|  ·  Σ_{o_i ∈ T} Σ_t log π_θ(a_t | s_t)

    `positive` [B], True for the responses in T; `num_tokens` their tokens in the whole minibatch when it is
    split into micro-batches (see masked_mean). 0 where none passes."""
    positive_mask = mask * positive.unsqueeze(1)
    return (-logprobs * positive_mask).sum() / (positive_mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, num_tokens=None, weights=None,
                cliprange_high=None):
    """Clipped surrogate (PPO eq. 7), negated, averaged over every valid token of the minibatch (a token-level
    loss, as VAPO's; see masked_mean for `num_tokens`):
        L = mean_t w_t max( −Â_t ρ_t, −Â_t clip(ρ_t, 1 − ε, 1 + ε_high) ),   ρ_t = π_θ(a_t|s_t) / π_old(a_t|s_t)
    ε_high = `cliprange_high` (clip-higher), ε where None; w_t = `weights` where the sampler was not π_old
    (sampler_importance_weights), else 1. Returns (loss, ratio)."""
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(logprobs - old_logprobs)
    losses = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - cliprange, 1 + high))
    return masked_mean(losses if weights is None else losses * weights, mask, num_tokens), ratio


def masked_value_loss(values, old_values, returns, mask, cliprange_value, num_tokens=None):
    """Clipped value loss, averaged over valid tokens (see masked_mean for `num_tokens`):
        L = ½ mean_t max( (V − R)², (V_old + clip(V − V_old, −ε, ε) − R)² )"""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask, num_tokens)


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


def sampler_mismatch(old_logprobs, sampler_logprobs, mask, bound):
    """How far the sampler is from the policy the update starts from, over the rollout's tokens, for the rollout/
    tags: the sum and the max of |log π_sampler − log π_old|, the sum of k3, the per-token estimate of
    KL[π_sampler ‖ π_old] on the sampler's own tokens (log r = log π_old − log π_sampler, k3 = r − 1 − log r), and
    the number of tokens whose ratio π_old/π_sampler lies outside [1/C, C], C = `bound`. Sums, not means, so that
    ranks add up; the tags divide by the tokens."""
    log_r = (old_logprobs - sampler_logprobs) * mask
    return (log_r.abs().sum(), log_r.abs().max(), ((log_r.exp() - 1 - log_r) * mask).sum(),
            ((log_r.abs() > math.log(bound)) * mask).sum())


def adaptive_kl_coef(kl_coef, current_kl, kl_target, horizon, n_steps):
    """The proportional controller of Ziegler et al. 2019 (section 2.2):
        e = clip(KL / KL_target − 1, −0.2, 0.2),   β ← β (1 + e · n_steps / horizon)"""
    error = min(max(current_kl / kl_target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_steps / horizon)


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
    """Every flag checked before any work: one line that says what to change. Under torchrun each rank checks
    the same flags and only rank 0 prints."""
    check_reward_flags(args)
    settle_lengths(args, {"response_length": (12, None), "max_prompt_length": (64, 512)})  # where not given
    # this script's own defaults, settled first: TRL corrects a sampler's tokens by default; here only a stale
    # sampler (--rollout-lag) needs it; --critic-lam and --actor-lam are --lam where not given (the actor's stays
    # unset under --length-adaptive-lam)
    if args.vllm_importance_sampling_correction is None:
        args.vllm_importance_sampling_correction = args.rollout_lag > 0
    if args.critic_lam is None:
        args.critic_lam = args.lam
    if args.actor_lam is None and args.length_adaptive_lam is None:
        args.actor_lam = args.lam
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"num_iterations": 1, "batch_size": 1, "mini_batch_size": 1, "ppo_epochs": 1,
                        "response_length": 1, "kl_horizon": 1, "eval_every": 1, "eval_size": 0, "eval_num_samples": 1,
                        "log_completions_every": 0, "value_warmup_steps": 0,
                        "gradient_accumulation_steps": 1, "generation_batch_size": 1}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "temperature": "> 0", "kl_coef": ">= 0",
                       "kl_target": "> 0", "cliprange": "> 0", "cliprange_value": "> 0", "vf_coef": ">= 0",
                       "cliprange_high": "> 0", "length_adaptive_lam": "> 0", "positive_lm_coef": ">= 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    if args.rollout_lag < 0:
        sys.exit(f"error: --rollout-lag {args.rollout_lag}: the iterations the sampler's weights lag, 0 or more")
    if args.rollout_lag and args.resume is not None:  # the K older weights are not in a checkpoint
        sys.exit("error: --resume with --rollout-lag: a checkpoint holds the current weights, not the K older ones the "
                 "sampler needs, so the run would not resume exactly; resume without --rollout-lag or start anew")
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    if args.vllm_importance_sampling_mode not in modes:
        sys.exit(f"error: --vllm-importance-sampling-mode {args.vllm_importance_sampling_mode!r}: choose one of "
                 f"{', '.join(modes)}")
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    for flag, value in (("clip-min", low), ("clip-max", high)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            sys.exit(f"error: --vllm-importance-sampling-{flag} {value}: it must be a finite number >= 0")
    if low is not None and high is not None and low >= high:
        sys.exit(f"error: --vllm-importance-sampling-clip-min {low} must be below --vllm-importance-sampling-clip-max "
                 f"{high}")
    for name in ("gamma", "lam", "critic_lam", "actor_lam"):
        if getattr(args, name) is not None and not 0 <= getattr(args, name) <= 1:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be in [0, 1]")
    if args.length_adaptive_lam is not None and args.actor_lam is not None:
        sys.exit(f"error: --length-adaptive-lam {args.length_adaptive_lam} sets the actor's λ; leave out --actor-lam")
    if args.value_warmup_steps and args.vf_coef == 0:
        sys.exit(f"error: --value-warmup-steps {args.value_warmup_steps} trains the critic alone, which --vf-coef 0 "
                 "gives no gradient: it would train nothing")
    needs_pass = args.positive_lm_coef > 0 and args.dataset_name is not None and not args.reward_fn
    if needs_pass:  # a reward model's score has no pass (see passes)
        sys.exit(f"error: --positive-lm-coef {args.positive_lm_coef} needs a reward function (--reward-fn) that tells "
                 "which responses pass; a reward model's score does not")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % args.mini_batch_size:
        sys.exit(f"error: --batch-size {args.batch_size} does not split into minibatches of {args.mini_batch_size}")
    if args.mini_batch_size % (world_size * args.gradient_accumulation_steps):
        sys.exit(f"error: --mini-batch-size {args.mini_batch_size} does not split into {world_size} rank(s) × "
                 f"{args.gradient_accumulation_steps} micro-batches; make it a multiple of "
                 f"{world_size * args.gradient_accumulation_steps}")
    if args.save_every < 0 or args.keep_checkpoints < 1:
        sys.exit("error: --save-every must be ≥ 0 and --keep-checkpoints ≥ 1")
    terms = len(args.reward_fn) + (args.reward_model_path is not None)
    if not terms:
        sys.exit("error: --reward-model-path None and no --reward-fn: there is no reward; give one or both")
    if args.reward_weights and len(args.reward_weights) != terms:
        sys.exit(f"error: --reward-weights has {len(args.reward_weights)} values for {terms} reward terms (one per "
                 "--reward-fn, in order, then one for the reward model)")
    if not all(map(math.isfinite, (args.missing_eos_penalty, *args.reward_weights))):  # rewards: either sign
        sys.exit(f"error: --missing-eos-penalty {args.missing_eos_penalty}, --reward-weights {list(args.reward_weights)}: "
                 "each must be a finite number")
    if args.reward_weights and not any(args.reward_weights) and not args.missing_eos_penalty:
        sys.exit(f"error: --reward-weights {' '.join(map(str, args.reward_weights))}: every term weighs 0, so every "
                 "reward is 0 and nothing is learned; give a term a weight")
    check_lora(args)


def main(args: Args):
    settle_defaults(args)  # --bf16 and --gradient-checkpointing, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    # the score: the reward model's (by default), the reward functions', or their weighted sum
    reward_model_path = args.reward_model_path
    functions = load_reward_functions(args.reward_fn, BUILTIN_REWARDS, args.format_pattern)
    guard = reward_guard(functions, args)  # --reward-num-workers: forked now, before any model is loaded
    weights = args.reward_weights or (1.0,) * (len(functions) + (reward_model_path is not None))
    checkpoint = find_checkpoint(args, int(os.environ.get("WORLD_SIZE", "1")))  # --resume: checked before any work
    rank, world_size, device = setup_distributed(args.cuda)
    run_dir = run_directory(args, checkpoint, device)  # under torchrun: seen by every rank, or one line
    per_rank, mini_per_rank = args.batch_size // world_size, args.mini_batch_size // world_size
    micro_size = micro_batch_size(args)
    random.seed(args.seed)  # the prompts drawn: the same on every rank, which each takes its share of
    torch.manual_seed(args.seed + rank)  # sampling: a stream of its own on each rank
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: autocast(device, args)  # noqa: E731  --bf16 without FSDP

    train_rows, eval_rows = load_data(args, prompt_row, 50_000, [("prompt",)], "needs a `prompt` column")
    train_rows, eval_rows = add_system_prompt(train_rows, args), add_system_prompt(eval_rows, args)
    check_reward_signatures(functions, sorted(train_rows[0]) if train_rows else [])  # the columns they receive
    if len(train_rows) < args.batch_size:
        sys.exit(f"error: {len(train_rows)} training prompts, fewer than --batch-size {args.batch_size}; lower it")
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    tokenizer, stop_ids, raw_actor, actor, ref, reward, raw_critic, critic = load_models(args, reward_model_path, device)
    train_rows, train_ids = tokenize_prompts(tokenizer, train_rows, args.max_prompt_length, "train")
    if len(train_ids) < args.batch_size:
        sys.exit(f"error: {len(train_ids)} training prompts fit --max-prompt-length, fewer than --batch-size {args.batch_size}")
    eval_rows, eval_ids = tokenize_prompts(tokenizer, eval_rows, args.max_prompt_length, "eval")
    positions, longest = model_positions(raw_actor), max(len(ids) for ids in train_ids + eval_ids)
    settle_room(args, "response_length", 512, "TRL's max_completion_length", (positions or math.inf) - longest)
    if positions is not None and longest + args.response_length > positions:
        sys.exit(f"error: the longest prompt ({longest} tokens) + --response-length {args.response_length} exceeds the "
                 f"model's {positions} positions; lower --max-prompt-length or --response-length")
    check_kv_cache(raw_actor, min(args.generation_batch_size, max(per_rank, -(-len(eval_ids) // world_size))),
                   longest + args.response_length, device, args.bf16)

    trained = torch.nn.ModuleList([actor, critic])  # what a checkpoint saves
    # on CUDA AdamW's fused kernel (one launch for every tensor, TRL's default); on the CPU torch's default
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=args.lr,
                                  fused=True if device.type == "cuda" else None)
    choose_head(device, args.fsdp, micro_size, longest + args.response_length,
                raw_actor.get_output_embeddings().weight.shape[0])
    lag = RolloutLag(raw_actor, args)  # --rollout-lag K: the weights a rollout samples with
    print(f"actor and critic: {parameter_count(raw_actor, raw_critic)}; "
          f"{3 + (reward is not None) - (ref is None)} model(s) in memory")
    kl_coef = args.kl_coef
    writer = make_writer(args, rank, run_dir, checkpoint["step"] if checkpoint else 0)
    terms = RewardTerms(functions, weights, reward,
                        [name for name, _ in functions] + (["reward_model"] if reward is not None else []), guard)
    # the score of each response, Σ_k w_k r_k over the reward functions and the reward model (completion_rewards)
    scores_of = functools.partial(completion_rewards, terms=terms, tokenizer=tokenizer, stop_ids=stop_ids, args=args)

    def logprobs_of(model, sequences, attention_mask, context_length):
        """(log π(a_t | s_t), entropy) of every response token, a micro-batch at a time (what fits with gradients
        fits without): in a rollout these are exactly the update's chunks, so the first ratio is exactly 1."""
        return forward_in_chunks(lambda s, a: policy_logprobs(model, s, a, context_length, args.temperature),
                                 micro_size, sequences, attention_mask)

    # ---- the loop: an evaluation before any update (not on a resume), then rollout, advantages, update and log ----
    models = (actor, raw_actor, critic, ref, tokenizer, stop_ids, logprobs_of)
    rng, first_iteration, elapsed = random.Random(args.seed), 1, 0.0  # rng: the prompts drawn
    if checkpoint is None:
        evaluate(models, eval_rows, eval_ids, terms, scores_of, amp, writer, 0, args)
        warm_up_critic(models, optimizer, train_rows, train_ids, scores_of, terms, rng, amp, writer, args)  # VC-PPO
    else:  # actor and critic, AdamW, every random stream, the KL coefficient, and where the loop was
        loop = load_checkpoint(checkpoint, trained, optimizer)
        first_iteration, elapsed, kl_coef = loop["step"] + 1, loop["elapsed"], loop["kl_coef"]
        rng.setstate(loop["rng"])
    preemption = Preemption()
    start_time = time.time() - elapsed  # the speeds count the time before a resume
    progress = Progress(args.num_iterations, "iterations", args.progress and rank == 0, done=first_iteration - 1)
    for iteration in range(first_iteration, args.num_iterations + 1):
        lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr
        optimizer.param_groups[0]["lr"] = lr
        # ---- 1. rollout: sample this rank's share of the prompts, then score every token with the four models --
        actor.eval(), critic.eval()
        chosen = rng.sample(range(len(train_ids)), args.batch_size)[rank * per_rank : (rank + 1) * per_rank]
        with torch.no_grad(), amp():
            with lag:  # --rollout-lag K: sampled with the weights of K iterations before
                sampled = generate_in_chunks(raw_actor, [train_ids[i] for i in chosen], tokenizer.pad_token_id,
                                             stop_ids, args.response_length, args.temperature,
                                             args.generation_batch_size)
            batch = score_rollout(models, [train_rows[i] for i in chosen], sampled, scores_of, terms, args)
            # ---- 2. advantages: per-token rewards with the KL penalty, GAE, whitened over the batch (all ranks) --
            rewards, non_score = shaped_rewards(batch.logprobs, batch.ref_logprobs, batch.scores.nan_to_num(0.0),
                                                batch.mask, kl_coef)
            lam = args.actor_lam if args.length_adaptive_lam is None else length_adaptive_lam(batch.train_mask,
                                                                                                args.length_adaptive_lam)
            advantages, returns = decoupled_gae(rewards, batch.values, batch.train_mask, args.gamma, lam, args.critic_lam)
            advantages = masked_whiten(advantages, batch.train_mask)  # over the whole batch, all ranks together

        # ---- 3. update: several epochs of shuffled minibatches, each in micro-batches ---------------------
        actor.train(), critic.train()
        stats = {k: [] for k in ("pg_loss", "vf_loss", "lm_loss", "approx_kl", "clipfrac", "ratio", "entropy")}
        for epoch in range(args.ppo_epochs):
            # the rollout's prompts are already in random order: epoch 0 takes them as they come, so its
            # first minibatch is exactly the rollout's first chunk; later epochs reshuffle
            order = torch.randperm(per_rank, device=device) if epoch > 0 else torch.arange(per_rank, device=device)
            for start in range(0, per_rank, mini_per_rank):  # each rank takes its share of every minibatch
                mb = order[start : start + mini_per_rank]
                # the losses: means over these (1 where every response of the minibatch is unscored: loss 0)
                counts = all_reduce_sum({"tokens": batch.train_mask[mb].sum(),  # and those of the responses that pass
                                         "positive": (batch.train_mask[mb] * batch.passed[mb, None]).sum()}, device)
                num_tokens, num_positive = max(1.0, counts["tokens"]), max(1.0, counts["positive"])
                for micro in range(0, mini_per_rank, micro_size):
                    idx = mb[micro : micro + micro_size]
                    for model in (actor, critic):  # once per step, with the last micro-batch
                        gradient_sync(model, micro + micro_size == mini_per_rank)
                    with amp():
                        new_logprobs, new_entropy = policy_logprobs(actor, batch.sequences[idx], batch.attention_mask[idx],
                                                                    batch.context_length, args.temperature)
                        new_values = critic(batch.sequences[idx], batch.attention_mask[idx])[:, batch.context_length - 1 : -1]
                    pg_loss, ratio = policy_loss(new_logprobs, batch.logprobs[idx], advantages[idx], batch.train_mask[idx],
                                                 args.cliprange, num_tokens,
                                                 None if batch.is_weights is None else batch.is_weights[idx],
                                                 args.cliprange_high)
                    vf_loss = masked_value_loss(new_values, batch.values[idx], returns[idx], batch.train_mask[idx],
                                                args.cliprange_value, num_tokens)
                    lm_loss = (positive_lm_loss(new_logprobs, batch.train_mask[idx], batch.passed[idx], num_positive)
                               if args.positive_lm_coef else pg_loss.new_zeros(()))  # VAPO
                    loss = pg_loss + args.vf_coef * vf_loss + args.positive_lm_coef * lm_loss
                    # DDP and FSDP average the ranks' gradients; × world_size turns that into the minibatch's sum
                    (loss * world_size).backward()
                    accumulate_ppo_stats(stats, (pg_loss, vf_loss, lm_loss), ratio, new_logprobs - batch.logprobs[idx],
                                         new_entropy, batch.train_mask[idx], num_tokens, epoch == start == micro == 0, args)
                grad_norm = torch.nn.utils.clip_grad_norm_(list(actor.parameters()) + list(critic.parameters()),
                                                           args.max_grad_norm)
                check_finite(iteration, loss=loss, grad_norm=grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)  # no gradients held through the next rollout

        # ---- 4. log, and the KL controller: statistics of the whole batch, sums added up over the ranks -----
        kl = log_ppo_iteration(writer, iteration, batch, stats, non_score, returns, kl_coef, lr, start_time, args)
        progress(iteration, f"score {float(batch.scores.nanmean()):.3f}")
        if args.kl_target is not None:
            kl_coef = adaptive_kl_coef(kl_coef, kl, args.kl_target, args.kl_horizon, args.batch_size)
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            evaluate(models, eval_rows, eval_ids, terms, scores_of, amp, writer, iteration, args)

        # ---- checkpoint: every --save-every iterations, and at SIGTERM, which then ends the run (exit code 0) --
        sigterm = bool(all_reduce_sum({"sigterm": preemption.received}, device)["sigterm"])  # on any rank
        if sigterm or (args.save_every and iteration % args.save_every == 0):
            save_checkpoint(run_dir, iteration, trained, optimizer, args,
                            {"rng": rng.getstate(), "kl_coef": kl_coef, "elapsed": time.time() - start_time}, sigterm)
        if sigterm:
            return writer.close()

    save_model(raw_actor, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


def warm_up_critic(models, optimizer, rows, ids, scores_of, terms, rng, amp, writer, args):
    """0. value warm-up (VC-PPO's value pretraining, arXiv 2503.01491, section 4.1): --value-warmup-steps rollouts
    of the starting policy train the critic alone, in the update's epochs, minibatches and micro-batches, towards
    λ = 1 (Monte Carlo) returns. The critic starts as the reward model, whose head scores whole responses, not the
    value of a response's first tokens: without the warm-up the actor's first advantages carry that bias. The actor
    keeps its weights (it has no gradients, so AdamW leaves it). Each rank takes its share of each rollout, as in
    the loop. Logged as val/warmup_value_loss and val/warmup_explained_variance (before each rollout's steps, as
    val/explained_variance). Not on a resume: the checkpoint holds the warmed critic."""
    actor, raw_actor, critic, _, tokenizer, stop_ids, _ = models
    rank, world_size = rank_and_world_size()
    per_rank, mini_per_rank = args.batch_size // world_size, args.mini_batch_size // world_size
    micro_size = micro_batch_size(args)
    num_minibatches = args.ppo_epochs * args.batch_size // args.mini_batch_size
    for step in range(1, args.value_warmup_steps + 1):
        actor.eval(), critic.eval()
        chosen = rng.sample(range(len(ids)), args.batch_size)[rank * per_rank : (rank + 1) * per_rank]
        with torch.no_grad(), amp():
            sampled = generate_in_chunks(raw_actor, [ids[i] for i in chosen], tokenizer.pad_token_id, stop_ids,
                                         args.response_length, args.temperature, args.generation_batch_size)
            batch = score_rollout(models, [rows[i] for i in chosen], sampled, scores_of, terms, args)
            rewards, _ = shaped_rewards(batch.logprobs, batch.ref_logprobs, batch.scores.nan_to_num(0.0), batch.mask,
                                        args.kl_coef)
            _, returns = masked_gae(rewards, batch.values, batch.train_mask, args.gamma, 1.0)
        critic.train()
        device, losses = returns.device, []
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(per_rank, device=device) if epoch > 0 else torch.arange(per_rank, device=device)
            for start in range(0, per_rank, mini_per_rank):
                mb = order[start : start + mini_per_rank]
                num_tokens = max(1.0, all_reduce_sum({"tokens": batch.train_mask[mb].sum()}, device)["tokens"])
                for micro in range(0, mini_per_rank, micro_size):
                    idx = mb[micro : micro + micro_size]
                    gradient_sync(critic, micro + micro_size == mini_per_rank)
                    with amp():
                        new_values = critic(batch.sequences[idx], batch.attention_mask[idx])[:, batch.context_length - 1 : -1]
                    vf_loss = masked_value_loss(new_values, batch.values[idx], returns[idx], batch.train_mask[idx],
                                                args.cliprange_value, num_tokens)
                    (args.vf_coef * vf_loss * world_size).backward()
                    losses.append(vf_loss.detach())
                grad_norm = torch.nn.utils.clip_grad_norm_(list(critic.parameters()), args.max_grad_norm)
                check_finite(f"warm-up {step}", value_loss=vf_loss, grad_norm=grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        valid, residual = batch.mask.bool(), (returns - batch.values).double()
        r = returns.double()[valid]
        sums = all_reduce_sum({"loss": torch.stack(losses).sum(), "n": valid.sum(), "r": r.sum(), "rr": (r * r).sum(),
                               "e": residual[valid].sum(), "ee": (residual[valid] ** 2).sum()}, device)
        var_returns, var_residual = sums["rr"] - sums["r"] ** 2 / sums["n"], sums["ee"] - sums["e"] ** 2 / sums["n"]
        writer.add_scalar("val/warmup_value_loss", sums["loss"] / num_minibatches, step)
        writer.add_scalar("val/warmup_explained_variance",
                          1 - var_residual / var_returns if var_returns > 0 else float("nan"), step)
        if rank == 0:
            print(f"value warm-up {step}: value loss {sums['loss'] / num_minibatches:.4f}")


@dataclass
class Rollout:
    """B responses and what the four models made of them; token tensors are [B, response_length]."""
    sequences: torch.Tensor  # prompt and response token ids, [B, context_length + response_length]
    attention_mask: torch.Tensor
    context_length: int  # the prompts' padded width: responses start at this column
    mask: torch.Tensor  # 1.0 on response tokens up to and including the stop token
    train_mask: torch.Tensor  # the tokens with a loss: not those of a response no reward function scores
    logprobs: torch.Tensor  # log π_old of each response token
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor  # log π_ref
    values: torch.Tensor  # V(s_t): the critic's value at the position that predicts response token t
    scores: torch.Tensor  # [B]: the score of each response (NaN where no reward function scores it)
    table: torch.Tensor  # [B, K]: each term of the score, NaN where it does not apply
    names: list  # the table's columns
    has_stop: torch.Tensor  # [B]: the response ended with a stop token
    prompts: list  # each response's prompt, as the dataset has it
    completions: list  # the responses' text
    failures: dict  # rewards/<name>_timeouts and _errors: completions whose reward call failed since the last one
    passed: torch.Tensor  # [B]: the response passes (passes; False where nothing tells), for --positive-lm-coef
    mismatch: tuple  # the sampler's distance from π_old (sampler_mismatch)
    is_weights: torch.Tensor | None  # the sampler correction's weights (sampler_correction); None without it


def score_rollout(models, rows, sampled, scores_of, terms, args):
    """Every token of the sampled responses scored by the four models: π_old's log-probs and entropy, π_ref's
    log-probs, the critic's values, and the score of each response (`terms`: RewardTerms); and the sampler's distance from π_old with
    the weights that correct for it. In chunks of the update's micro-batches, so that they compute exactly what
    the update will."""
    actor, _, critic, ref, _, _, logprobs_of = models
    sequences, attention_mask, context_length, mask, sampler_logprobs = sampled
    mask = mask.float()
    logprobs, entropy = logprobs_of(actor, sequences, attention_mask, context_length)
    ref_logprobs, _ = logprobs_of(ref, sequences, attention_mask, context_length)
    values = forward_in_chunks(lambda s, a: critic(s, a)[:, context_length - 1 : -1], micro_batch_size(args),
                               sequences, attention_mask)
    scores, table, completions, has_stop = scores_of(rows, sequences, attention_mask, context_length, mask)
    # a response no reward function scores (NaN) has no loss: advantage 0, as TRL 1.16 gives it in GRPO
    train_mask = mask * ~scores.isnan().unsqueeze(1)
    return Rollout(sequences, attention_mask, context_length, mask, train_mask, logprobs, entropy, ref_logprobs,
                   values, scores, table, terms.names, has_stop, [row["prompt"] for row in rows], completions,
                   terms.guard.counts(),
                   torch.tensor(passes(completions, rows, table, terms.names, args.dataset_name is None) or [False] * len(rows),
                                device=mask.device),
                   *sampler_correction(logprobs, sampler_logprobs, mask, args))


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
            micro_batch_size(args), sequences, attention_mask, response_mask)
        table = torch.cat([table, scores.float()[:, None]], 1)
    responses = sequences[:, context_length:]
    has_stop = (torch.isin(responses, torch.tensor(stop_ids, device=sequences.device)) & response_mask.bool()).any(1)
    rewards = combine_rewards(table, terms.weights)
    rewards = torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty))
    return rewards, table, completions, has_stop


@torch.no_grad()
def accumulate_ppo_stats(stats, losses, ratio, log_ratio, entropy, mask, num_tokens, first, args):
    """Appends a micro-batch's losses (policy, value, positive-example LM) and statistics to `stats` (log_ratio:
    log π_θ − log π_old; clipfrac: the tokens whose ratio lies outside [1 − ε, 1 + ε_high]), kept on the device and
    read once after the update (no waiting inside a step); at the first micro-batch of an iteration, before any
    step, the ratio's largest distance from 1 (it must be exactly 0)."""
    for name, loss in zip(("pg_loss", "vf_loss", "lm_loss"), losses):
        stats[name].append(loss.detach())
    high = args.cliprange if args.cliprange_high is None else args.cliprange_high
    clipped = (ratio - 1 > high) | (1 - ratio > args.cliprange)
    stats["approx_kl"].append(masked_mean(0.5 * log_ratio ** 2, mask, num_tokens))
    stats["clipfrac"].append(masked_mean(clipped.float(), mask, num_tokens))
    stats["ratio"].append(masked_mean(ratio, mask, num_tokens))
    stats["entropy"].append(masked_mean(entropy, mask, num_tokens))
    if first:
        stats["first_ratio_max_error"] = (ratio - 1).abs().max()


def log_ppo_iteration(writer, iteration, batch, stats, non_score, returns, kl_coef, lr, start_time, args):
    """An iteration's statistics of the whole batch, each rank's sums added up over the ranks, to TensorBoard
    (docs/tags.md), and a line every 10 iterations; every --log-completions-every iterations, rank 0's first
    responses as text. Returns the batch's KL to the reference (k1), which the adaptive KL controller reads."""
    first_ratio_error, logprob_diff_max = stats.pop("first_ratio_max_error"), batch.mismatch[1]
    mask, mismatch, device = batch.mask, batch.mismatch, batch.mask.device
    stats = {name: torch.stack(parts).tolist() for name, parts in stats.items()}
    valid, residual = mask.bool(), (returns - batch.values).double()
    r = returns.double()[valid]
    k1, k3 = kl_estimators(batch.logprobs, batch.ref_logprobs, mask)
    corrected = {} if batch.is_weights is None else {"is_weight": (batch.is_weights * mask).sum(),
                                                     "is_masked": ((batch.is_weights == 0) * mask).sum()}
    sums = all_reduce_sum({"score": batch.scores.nansum(), "scored": (~batch.scores.isnan()).sum(),
                           "logprob_diff": mismatch[0], "kl_k3_sampler": mismatch[2], "outside": mismatch[3],
                           **corrected, "k1": k1.sum(), "k3": k3.sum(), "rollout_entropy": (batch.entropy * mask).sum(),
                           "non_score": non_score.sum(), "eos": batch.has_stop.sum(), "tokens": valid.sum(),
                           "passed": batch.passed.sum(),
                           "r": r.sum(), "rr": (r * r).sum(), "e": residual[valid].sum(),
                           "ee": (residual[valid] ** 2).sum(),
                           **{name: sum(parts) for name, parts in stats.items()},
                           **term_sums(batch.table, batch.names, "rewards/"), **batch.failures}, device)
    B, num_minibatches = args.batch_size, args.ppo_epochs * args.batch_size // args.mini_batch_size
    n = sums["tokens"]  # Var(R) and Var(R − V) over the valid tokens, both × (n − 1), which cancels
    var_returns, var_residual = sums["rr"] - sums["r"] ** 2 / n, sums["ee"] - sums["e"] ** 2 / n
    if dist.is_initialized():
        dist.all_reduce(first_ratio_error, op=dist.ReduceOp.MAX)  # the largest on any rank
        dist.all_reduce(logprob_diff_max, op=dist.ReduceOp.MAX)
    mean_score = sums["score"] / max(1, sums["scored"])  # over the scored responses
    logs = {
        "objective/reward": mean_score, "objective/kl": sums["k1"] / B, "objective/kl_k3": sums["k3"] / B,
        "objective/entropy": sums["rollout_entropy"] / B, "objective/non_score_reward": sums["non_score"] / B,
        "objective/rlhf_reward": mean_score + sums["non_score"] / B,
        # each of these: the sum of its micro-batch parts per minibatch, the mean over minibatches
        "policy/approx_kl": sums["approx_kl"] / num_minibatches, "policy/clipfrac": sums["clipfrac"] / num_minibatches,
        "policy/ratio_mean": sums["ratio"] / num_minibatches, "policy/entropy": sums["entropy"] / num_minibatches,
        "policy/first_ratio_max_error": first_ratio_error,
        "losses/policy_loss": sums["pg_loss"] / num_minibatches, "losses/value_loss": sums["vf_loss"] / num_minibatches,
        **({"losses/positive_lm_loss": sums["lm_loss"] / num_minibatches, "policy/positive_fraction": sums["passed"] / B}
           if args.positive_lm_coef else {}),
        # 1 − Var(R − V) / Var(R) over the valid tokens (undefined when every return is the same)
        "val/explained_variance": 1 - var_residual / var_returns if var_returns > 0 else float("nan"),
        "val/num_eos": sums["eos"],
        "charts/kl_coef": kl_coef, "charts/learning_rate": lr,
        "charts/episodes_per_second": iteration * B / (time.time() - start_time),
        # the sampler against π_old (sampler_mismatch), over the rollout's tokens
        "rollout/logprob_diff_mean": sums["logprob_diff"] / n, "rollout/logprob_diff_max": logprob_diff_max,
        "rollout/kl_k3": sums["kl_k3_sampler"] / n, "rollout/ratio_outside_fraction": sums["outside"] / n,
    }
    if batch.is_weights is not None:  # the correction's weights: their mean, and the tokens they leave out (weight 0)
        logs["rollout/is_weight_mean"] = sums["is_weight"] / n
        logs["rollout/is_masked_fraction"] = sums["is_masked"] / n
    logs.update({tag: sums[tag] for tag in batch.failures})  # completions whose reward call failed, on every rank
    for name in batch.names:  # each term of the score, over the responses it applies to (the reward model's: score)
        if sums[f"rewards/{name}/n"] > 0:
            tag = "objective/score" if name == "reward_model" else f"rewards/{name}"
            logs[tag] = sums[f"rewards/{name}"] / sums[f"rewards/{name}/n"]
    for tag, value in logs.items():
        writer.add_scalar(tag, float(value), iteration)
    if args.log_completions_every and iteration % args.log_completions_every == 0:
        writer.add_text("train/completions", samples_markdown(batch.prompts, batch.completions, batch.scores,
                                                              batch.table, batch.names), iteration)
    if iteration % 10 == 0:
        print(f"iteration {iteration}: reward {logs['objective/reward']:.3f}, kl {logs['objective/kl']:.3f}, "
              f"eos {sums['eos'] / B:.2f}, {time.time() - start_time:.0f} s")
    return logs["objective/kl"]


def term_sums(table, names, prefix, w=None):
    """{prefix + name: Σ value, prefix + name + "/n": count} of each reward term over the completions it
    applies to (weighted by w), to be summed over the ranks; the term's mean is their ratio."""
    w = torch.ones(len(table), device=table.device) if w is None else w
    applies = ~table.isnan()
    sums = {f"{prefix}{name}": (table[:, k].nan_to_num() * w).sum() for k, name in enumerate(names)}
    return {**sums, **{f"{prefix}{name}/n": (applies[:, k] * w).sum() for k, name in enumerate(names)}}


@torch.no_grad()
def evaluate(models, eval_rows, eval_ids, terms, scores_of, amp, writer, iteration, args):
    """Responses to the eval prompts at --temperature (--eval-num-samples of each): their score and each of its
    terms, their KL to the reference (Σ_t log π_θ − log π_ref over a response), on the built-in task their gold
    reward, and with several samples pass@k. Each rank evaluates its shard of the prompts; the sums are added up
    over the ranks."""
    actor, raw_actor, _, ref, tokenizer, stop_ids, logprobs_of = models
    if not eval_ids:
        return
    actor.eval()
    k, (mine, prompt_weights) = args.eval_num_samples, shard(list(range(len(eval_ids))), *rank_and_world_size())
    rows, weights = [eval_rows[j] for j in mine for _ in range(k)], [v for v in prompt_weights for _ in range(k)]
    with amp():
        sequences, attention_mask, context_length, response_mask, _ = generate_in_chunks(
            raw_actor, [eval_ids[j] for j in mine for _ in range(k)], tokenizer.pad_token_id, stop_ids,
            args.response_length, args.temperature, args.generation_batch_size)
        logprobs, _ = logprobs_of(actor, sequences, attention_mask, context_length)
        ref_logprobs, _ = logprobs_of(ref, sequences, attention_mask, context_length)
        scores, table, completions, _ = scores_of(rows, sequences, attention_mask, context_length, response_mask)
    device = sequences.device
    w = torch.tensor(weights, device=device, dtype=torch.float)
    sums = {"kl": (((logprobs - ref_logprobs) * response_mask).sum(1) * w).sum(), "reward": (scores * w).nansum(),
            "n": w.sum(), "scored": (w * ~scores.isnan()).sum(), **term_sums(table, terms.names, "rewards/", w)}
    if args.dataset_name is None:  # the built-in task: exactly the target, and the gold score
        targets = [row["target"] for row in rows]
        sums["correct"] = sum(v * (c == t) for c, t, v in zip(completions, targets, weights))
        sums["gold"] = sum(v * gold_score(c, t) for c, t, v in zip(completions, targets, weights))
    sums.update(pass_at_k_logs(passes(completions, rows, table, terms.names, args.dataset_name is None), k,
                               prompt_weights))
    sums = all_reduce_sum(sums, device)
    line = f"iteration {iteration}:"
    for tag, name in (("eval/reward", "reward"), ("eval/kl", "kl"), ("eval/gold_accuracy", "correct"),
                      ("eval/gold_score", "gold")):
        if name in sums:  # eval/reward: over the scored responses (an unscored one's score is NaN)
            value = sums[name] / sums["scored" if name == "reward" else "n"]
            writer.add_scalar(tag, value, iteration)
            line += f" {tag} {value:.3f}"
    for name in terms.names:  # each term's mean over the completions it applies to (the reward model's: eval/score)
        if sums[f"rewards/{name}/n"] > 0:
            tag = "eval/score" if name == "reward_model" else f"eval/rewards/{name}"
            writer.add_scalar(tag, sums[f"rewards/{name}"] / sums[f"rewards/{name}/n"], iteration)
            line += f" {tag} {sums[f'rewards/{name}'] / sums[f'rewards/{name}/n']:.3f}"
    for tag in [tag for tag in sums if tag.startswith("eval/pass@")]:  # over the prompts: n / k of them
        writer.add_scalar(tag, sums[tag] / (sums["n"] / k), iteration)
        line += f" {tag} {sums[tag] / (sums['n'] / k):.3f}"
    writer.add_text("eval/samples", samples_markdown([row["prompt"] for row in rows[::k]], completions[::k],
                                                     scores[::k], table[::k], terms.names), iteration)
    if iteration == 0:  # once: what the numbers are
        print(f"evaluation: {len(eval_ids):,} held-out prompts, {k} response(s) each sampled at --temperature "
              f"{args.temperature}; eval/reward is the training reward (--missing-eos-penalty "
              f"{args.missing_eos_penalty} included)" + ", eval/gold_* the answer alone" * (args.dataset_name is None))
    print(line)
    if args.dataset_name is not None and iteration == args.num_iterations:  # own data: what it learned
        print_samples([row["prompt"] for row in rows[::k]], completions[::k])  # rank 0's shard
    actor.train()


def pass_at_k_logs(passed, n, weights):
    """grpo.py's pass_at_k_logs as sums over this rank's prompts, each weighted (0 on shard's padding), for
    all_reduce_sum: {eval/pass@k: Σ_prompts w · pass_at_k} for k = 1, 2, 4, ... up to n, from `passed` (passes),
    the n samples of each prompt in adjacent rows; {} with one sample or no passes."""
    if passed is None or n == 1:
        return {}
    counts = torch.tensor(passed).view(-1, n).sum(1).tolist()
    return {f"eval/pass@{2 ** i}": sum(w * pass_at_k(n, c, 2 ** i) for c, w in zip(counts, weights))
            for i in range(n.bit_length()) if 2 ** i <= n}


def load_models(args, reward_model_path, device):
    """(tokenizer, stop_ids, raw actor, actor as trained, reference, reward model or None, raw critic, critic as
    trained): the four models of RLHF (three without a reward model). The trained ones in float32 (master weights)
    whatever the checkpoints' dtype, the reference as the actor (so that they agree exactly before the first
    update), the reward model in the dtype it computes in; dropout off in all (log-probs, values and scores must
    not be random). Each model loaded, then placed (on the device, whole or sharded) before the next: rank 0 holds
    one whole model at a time. The trained actor and critic are data-parallel; the frozen ones whole on every rank,
    or sharded."""
    tokenizer = load_tokenizer(args.model_name_or_path, "run `python sft.py` first or pass a path")
    if reward_model_path is not None:
        reward_tokenizer = load_tokenizer(reward_model_path, "run `python reward_model.py` first, pass a path, or None "
                                          "with --reward-fn")
        check_reward_model_data(reward_model_path, args.dataset_name)
    stop_ids = stop_token_ids(tokenizer)
    critic_path = reward_model_path or args.model_name_or_path  # the reward model, or the SFT model with a new head
    if reward_model_path is not None:
        check_same_vocabulary(tokenizer, reward_tokenizer, stop_ids,
                              f"the reward model {reward_model_path!r} has another tokenizer than the SFT model "
                              f"{args.model_name_or_path!r}; train it from the SFT model with reward_model.py")
    lm_config, critic_config = load_config(args.model_name_or_path, "lm"), load_config(critic_path, "score")
    raw_actor = load_no_dropout(args.model_name_or_path, "lm", base_dtype(args), lm_config)  # π_θ (raw: sample, save)
    prepare_models(tokenizer, stop_ids, [raw_actor])
    if args.gradient_checkpointing:
        raw_actor.activation_checkpointing_enable({"use_reentrant": False})
    raw_actor = add_lora(raw_actor, args)  # --lora-r: adapters on the frozen weights
    actor = place_model(raw_actor, device, args)
    if args.lora_r:
        ref = AdaptersOff(raw_actor)  # with LoRA, π_ref is π_θ with its adapters off
    else:
        ref = load_no_dropout(args.model_name_or_path, "lm", torch.float32, lm_config)  # π_ref
        prepare_models(tokenizer, stop_ids, [ref], [ref])
        if args.gradient_checkpointing:  # the policy's path, one pass (not shared_prompt_logprobs): equal at the start
            ref.activation_checkpointing_enable({"use_reentrant": False})
    ref = place_model(ref, device, args, trained=False)
    reward = None
    if reward_model_path is not None:  # r_φ
        reward = load_no_dropout(reward_model_path, "score", torch.bfloat16 if args.bf16 else torch.float32, critic_config)
        prepare_models(tokenizer, stop_ids, [reward], [reward])
        reward = place_model(TokenScorer(reward), device, args, trained=False)  # its forward: r_φ at every position
    raw_critic = load_no_dropout(critic_path, "score", base_dtype(args), critic_config)  # V_ψ
    prepare_models(tokenizer, stop_ids, [raw_critic])
    if args.gradient_checkpointing:
        raw_critic.activation_checkpointing_enable({"use_reentrant": False})
    raw_critic = add_lora(raw_critic, args)  # --lora-r; the critic's head trains whole
    critic = place_model(TokenScorer(raw_critic), device, args)  # its forward: V(s_t) at every position
    if args.compile:
        compile_blocks(raw_actor)
        compile_blocks(raw_critic)
    return tokenizer, stop_ids, raw_actor, actor, ref, reward, raw_critic, critic


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
    any), NaN where it returned None ("does not apply") or its call failed (counted). A function that failed on every
    completion of --max-reward-failures calls in a row stops the run with one line; under torchrun every rank learns
    of it on any (and stops) before the next collective."""
    table, error = torch.full((len(completions), len(functions)), float("nan")), None
    if not functions:  # the reward model alone
        return table
    for k, (name, fn) in enumerate(functions):
        try:
            values = call_reward(guard, name, fn, prompts, completions, columns)
        except SystemExit as e:  # its failures in a row: every rank stops
            error = str(e.code)
            break
        table[:, k] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        sys.exit(error)
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


ROW_CHUNK_ELEMENTS = 2**22  # float32 elements of logits processed at once: 16 MiB


def rowwise(fn, *tensors):
    """fn over a few rows (sequences) of `tensors` at a time, as many as keep a chunk of logits within
    ROW_CHUNK_ELEMENTS (one row at 1,024 tokens and a 128k vocabulary; the whole batch on the built-in task),
    the results concatenated. With gradients on, each chunk's forward is recomputed in the backward pass
    (activation checkpointing), so that the float32 intermediates ([length, vocabulary] per row: 0.5 GB at
    1,024 tokens and 128k) exist one chunk at a time and only the logits themselves, as the model returned
    them, are kept for the backward pass."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    rows = max(1, ROW_CHUNK_ELEMENTS // max(1, tensors[0][0].numel()))
    chunks = zip(*(t.split(rows) for t in tensors))
    return torch.cat([checkpoint(fn, *chunk, use_reentrant=False) if grad else fn(*chunk) for chunk in chunks])


def token_logprobs(logits, tokens, with_entropy=False, temperature=1.0):
    """log π(token) = z(token) − logsumexp(z) at each position, z = logits / temperature in float32 (as
    `generate` draws tokens: the logits upcast before the temperature divides them), and optionally the
    entropy H = logsumexp(z) − Σ softmax(z)·z (with_entropy "grad": with its gradient, for an entropy bonus). A few
    rows at a time (rowwise): no float32 [batch, length, vocabulary] tensor is made or kept."""
    def chunk_logprobs(rows, row_tokens):
        z = rows.float() / temperature
        return z.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)

    def chunk_entropy(rows):
        z = rows.float() / temperature
        return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)

    logprobs = rowwise(chunk_logprobs, logits, tokens)
    if not with_entropy:
        return logprobs
    with torch.set_grad_enabled(with_entropy == "grad" and torch.is_grad_enabled()):
        return logprobs, rowwise(chunk_entropy, logits)


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


def last_token_index(attention_mask):
    """Index of the last non-pad token of each row, under left or right padding: the largest position
    whose mask is 1 (for right padding, the number of tokens − 1)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def policy_logprobs(model, sequences, attention_mask, context_length, temperature, entropy_grad=False):
    """(log π(a_t | s_t) of each response token, the entropy of π(·|s_t)), z divided by the sampling temperature
    in float32 as when sampling: from one forward pass over prompt + response, the LM head applied to the response
    positions only and in chunks (head_logprobs), or, where rows repeat a prompt (GRPO's G completions of each),
    from shared_prompt_logprobs. The entropy has a gradient with entropy_grad only (an entropy bonus)."""
    with_entropy = "grad" if entropy_grad else True
    shared = shared_prompt_logprobs(model, sequences, attention_mask, context_length, temperature, with_entropy)
    if shared is not None:
        return shared
    scored = sequences.shape[1] - context_length + 1  # position t predicts token t + 1: context_length − 1 onwards
    logprobs, entropy = head_logprobs(model, F.pad(sequences[:, context_length:], (0, 1)), temperature, with_entropy,
                                      input_ids=sequences, attention_mask=attention_mask,
                                      position_ids=position_ids_of(attention_mask), logits_to_keep=scored)
    return logprobs[:, :-1], entropy[:, :-1]  # the last position predicts nothing


# The KV cache's name as a model's forward takes and returns it: transformers 5.24 renamed past_key_values to cache
# (the old keyword still works there, with a FutureWarning on every call)
CACHE = "cache" if tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


def shared_prompt_logprobs(model, sequences, attention_mask, context_length, temperature, with_entropy=True):
    """policy_logprobs with each distinct prompt of the batch computed once: one forward pass over the distinct
    prompts, whose keys and values (the KV cache, as in generation) every row that repeats the prompt reuses, then
    one over the responses. A causal model's prompt positions never see the response, so this is the same function
    of the weights as one pass over prompt + response (equal up to float rounding; the rollout and the update both
    take this path, so the first ratio stays exactly 1), with the prompt's FLOPs divided by the rows that share it;
    gradients flow through the cache like any activation. None, for one pass instead, when no prompt repeats, the
    responses are one token long, with activation checkpointing (which keeps no cache), or on a GPU: there a pass
    costs its kernel launches more than its FLOPs, and two passes took twice as long as one (an H100, a 0.5B model,
    8 completions of each 200-token prompt in micro-batches of 16, measured once); on the CPU the FLOPs
    saved count."""
    if sequences.device.type != "cpu" or any(getattr(m, "gradient_checkpointing", False) is True
                                             for m in model.modules()):
        return None
    prompts = torch.cat([sequences[:, :context_length], attention_mask[:, :context_length]], 1)
    distinct, row_prompt = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) == len(sequences) or sequences.shape[1] - context_length < 2:
        return None
    prompt_ids, prompt_mask = distinct[:, :context_length], distinct[:, context_length:]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_of(prompt_mask),
                use_cache=True, logits_to_keep=1)  # the last prompt position predicts the first response token
    first = token_logprobs(out.logits[row_prompt], sequences[:, context_length : context_length + 1], with_entropy,
                           temperature)
    cache = out[CACHE]
    cache.batch_select_indices(row_prompt)  # each row's prompt: a gather, differentiable
    positions = position_ids_of(attention_mask)
    rest = head_logprobs(model, sequences[:, context_length + 1 :], temperature, with_entropy,
                         input_ids=sequences[:, context_length:-1], attention_mask=attention_mask[:, :-1],
                         position_ids=positions[:, context_length:-1], use_cache=True, **{CACHE: cache})
    return torch.cat([first[0], rest[0]], 1), torch.cat([first[1], rest[1]], 1)


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


@torch.no_grad()
def response_scores(reward, sequences, attention_mask, response_mask, stop_ids, missing_eos_penalty):
    """The reward model's score (`reward`: a TokenScorer, or FSDP around one) at each response's last token, its
    stop token; `missing_eos_penalty` instead for a response with no stop token in the length sampled (an
    unfinished answer is not scored). Returns (scores, has_stop)."""
    scores = reward(sequences, attention_mask)[torch.arange(len(sequences)), last_token_index(attention_mask)]
    responses = sequences[:, -response_mask.shape[1] :]
    has_stop = (torch.isin(responses, torch.tensor(stop_ids, device=responses.device)) & response_mask.bool()).any(1)
    return torch.where(has_stop, scores, torch.full_like(scores, missing_eos_penalty)), has_stop


def forward_in_chunks(fn, size, *tensors):
    """fn over the rows of `tensors`, `size` rows at a time, the outputs concatenated. In a rollout the chunks
    are the rows the update passes through the model at once, so that they compute exactly what the update's
    forward passes will (the first PPO ratio is exactly 1)."""
    outs = [fn(*(t[i : i + size] for t in tensors)) for i in range(0, len(tensors[0]), size)]
    return tuple(torch.cat(parts) for parts in zip(*outs)) if isinstance(outs[0], tuple) else torch.cat(outs)


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


def check_kv_cache(model, rows, length, device, bf16):
    """On CUDA, one line before the first rollout when sampling `rows` sequences of `length` tokens at once would
    fill the device: their KV cache (kv_cache_bytes) may take at most half the memory free beside the placed
    models. Lower --generation-batch-size; on the CPU, no check."""
    if device.type != "cuda":
        return
    need, free = kv_cache_bytes(model, rows, length, bf16), torch.cuda.mem_get_info(device)[0]
    if all_reduce_sum({"full": need > free / 2}, device)["full"]:  # on any rank: every rank stops
        sys.exit(f"error: --generation-batch-size {rows} × {length} tokens needs a KV cache of {need / 2**30:.1f} GiB, "
                 f"more than half the {free / 2**30:.1f} GiB free on the GPU; pass --generation-batch-size "
                 f"{max(1, int(rows * free / 2 / need))} or less")


def kv_cache_bytes(model, rows, length, bf16):
    """The bytes of the KV cache of `rows` sequences of `length` tokens: layers × KV heads × head size numbers per
    token for the keys and as many for the values. The values are 2 bytes under --bf16 (autocast's bf16
    projections) and the keys as wide as the weights: a rotary embedding in the weights' dtype makes them
    float32 over float32 weights even under autocast."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = model.dtype.itemsize
    return config.num_hidden_layers * heads * head_size * rows * length * (width + (2 if bf16 else width))


def generate_in_chunks(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature, size):
    """`generate` in chunks of `size` prompts (the KV cache grows with it), joined as one sample."""
    return join_samples([generate(model, prompt_ids[i : i + size], pad_token_id, stop_ids, max_new_tokens, temperature)
                         for i in range(0, len(prompt_ids), size)], pad_token_id)


def join_samples(samples, pad_token_id):
    """Outputs of `generate`, (sequences, attention_mask, context_length, response_mask, sampler_logprobs), as one:
    the rows of all, the prompts left-padded to the longest and the responses right-padded to the longest."""
    width, length = max(s[2] for s in samples), max(s[3].shape[1] for s in samples)
    pad = lambda t, left, value: F.pad(t, (left, width + length - left - t.shape[1]), value=value)  # noqa: E731
    return (torch.cat([pad(s[0], width - s[2], pad_token_id) for s in samples]),
            torch.cat([pad(s[1], width - s[2], 0) for s in samples]), width,
            *(torch.cat([F.pad(s[k], (0, length - s[k].shape[1])) for s in samples]) for k in (3, 4)))


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


def rank_and_world_size():
    """(rank, world_size) of this process: (0, 1) outside torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def micro_batch_size(args):
    """The rows of one forward pass with gradients: this rank's share of a minibatch over the accumulation steps
    (and the chunk of every pass without gradients: what fits with gradients fits without)."""
    return args.mini_batch_size // rank_and_world_size()[1] // args.gradient_accumulation_steps


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


class AdaptersOff(torch.nn.Module):
    """The reference policy of a LoRA run: the policy's own weights with its adapters switched off, instead of a
    second copy of the model. Its forward is the policy's, in eval mode, under peft's disable_adapter."""

    def __init__(self, policy):
        super().__init__()
        self.policy = [policy]  # in a list: not a submodule, so that no one counts, moves or saves it twice

    def forward(self, *args, **kwargs):
        policy = self.policy[0]
        training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter():
                return policy(*args, **kwargs)
        finally:
            policy.train(training)


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
    if any(arg.split("=")[0] == "--sft-model-path" for arg in sys.argv[1:]) and os.environ.get("RANK", "0") == "0":
        print("note: --sft-model-path is now --model-name-or-path (TRL's name); the old name works in this release")
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
