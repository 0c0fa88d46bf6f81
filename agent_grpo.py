"""Agent GRPO: multi-turn tool-use RL, GRPO over whole episodes in which the policy calls tools.

The rollout is an episode, as TRL's GRPOTrainer runs one with `tools=` or `environment_factory=`: the policy samples
an assistant turn; its calls are parsed as TRL parses them (transformers' parse_response, anchored at the context,
the arguments typed by the tools' schemas), run as Python functions, their results appended as the chat template
renders a tool turn, and the policy samples the next turn, until a turn calls none, --max-tool-calling-iterations
rounds of calls, or --max-completion-length tokens in all. With --environment, each episode has its own instance of
a class whose methods are the tools and whose state lasts the episode (reset before it, get_reward after). The G
episodes of a prompt are a group, and the reward of each gives one advantage Â_i, as in grpo.py, spread over
the tokens the policy sampled and only those: the tool results and the template's tokens between turns, which the
environment wrote, have m_it = 0 in the policy loss, the KL term, the entropy, the token normalizers and the length
statistics (Shao et al. 2024, eq. 3, with |o_i| = Σ_t m_it):

    J = E[ (1/G) Σ_i (1/|o_i|) Σ_t m_it ( min( ρ_it Â_i, clip(ρ_it, 1 − ε, 1 + ε) Â_i ) − β D_KL,t[π_θ ‖ π_ref] ) ]

Token-exact: the ids trained on are the ids the sampler drew, turn after turn (a turn is never decoded and encoded
again), and a tool turn's ids are the chat template's rendering of that turn alone: the conversation rendered with it
less the conversation rendered without it, cut after the assistant's end of turn (tool_turn_ids). Two built-in tasks,
offline: products of two or three numbers, which the tiny model cannot multiply and the tool `multiply` can (a product
of three takes two calls, the second on the first's result); and --environment treasure_hunt, a chain of rooms whose
notes lead to a chest's code, which only the environment knows.

    python agent_grpo.py --write-sft-data data/tools.jsonl    # demonstrations of the built-in task, for sft.py
    python sft.py --dataset-name data/tools.jsonl --max-length 400 --max-steps 400 --batch-size 32 --warmup-steps 40 \\
        --output-dir models/sft_tools
    python agent_grpo.py                                       # GRPO with the tool, from models/sft_tools
    python agent_grpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset-name my.jsonl \\
        --tools my_tools.py:search,lookup --reward-fn my_rewards.py:correct --lr 1e-6 --max-prompt-length 1024
    python agent_grpo.py --model-name-or-path Qwen/Qwen3-0.6B --environment my_env.py:Wordle --lr 1e-6 \\
        --max-prompt-length 1024                              # a stateful environment, its get_reward the reward

GRPO's default recipe around the tool mechanism: --loss-type grpo, dapo or dr_grpo, the KL to the reference,
clip-higher (--epsilon-high), --mask-truncated-completions. One process, one device; no scale/ sibling yet
(scale/grpo.py holds the other variants and the systems features, for single-turn GRPO).
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
    environment: str | None = None
    """a stateful environment, as TRL's environment_factory: MODULE_OR_FILE:CLASS, one instance per episode (the G
    of a prompt never share state), reset(**row) before it (its text, if any, appended to the last user message),
    its public methods the tools (as --tools, with them), and an optional get_reward() scoring the episode from the
    state (a reward term of weight 1, named after the class: --reward-fn is then optional). Without --dataset-name,
    reset makes the prompt (TRL's dataset-free training). The built-in `treasure_hunt`: docs/agent_grpo.md"""
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
    max_completion_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """the most tokens of an episode after its prompt, the policy's and the tools' together (TRL's rule: a tool
    result that would leave no room for another turn is dropped and the episode ends; a turn is cut at the
    limit); L_max of dr_grpo (default: 256 on the built-in task; on a dataset, TRL's max_completion_length 512,
    cut to what the model's positions leave)"""
    max_prompt_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """prompts longer than this many tokens (the tools' schemas included) are dropped (and counted), never cut
    (default: 64 on the built-in task, 512 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) compute in bfloat16 (autocast); weights and AdamW state float32"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training divide the logits by it too"""
    loss_type: str = "grpo"
    """grpo: mean over each episode's policy tokens, then over episodes; dapo: mean over all policy tokens of the
    rollout; dr_grpo: sum / (episodes × --max-completion-length) (TRL: loss_type; the other variants are grpo.py's
    and scale/grpo.py's)"""
    epsilon: float = 0.2
    """ε of the clipped surrogate (the lower bound, and the upper one unless --epsilon-high is set)"""
    epsilon_high: float | None = None
    """upper clip bound 1 + ε_high (DAPO's clip-higher, e.g. 0.28); None: ε"""
    beta: float = 0.04
    """β of the k3 KL penalty to the reference, on the policy's tokens only; 0 drops the reference model"""
    missing_eos_penalty: float = -1.0
    """the reward of an episode whose last turn was cut at --max-completion-length (no stop token): not scored"""
    mask_truncated_completions: bool = False
    """DAPO's overlong filtering: an episode cut at the limit gets no loss and no KL penalty"""
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
# environment's (tool results, the template's tokens between turns) and on padding. grpo.py's functions of
# its default recipe, pasted (compute_advantages, clipped_tokens and aggregate_loss with this file's rows only);
# episode_tokens is this file's. Checked against hand-computed values in tests/test_agent_grpo.py.
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


def compute_advantages(rewards, num_generations):
    """Â_i of each episode: GRPO's (group_advantages). An unscored episode (reward NaN: no reward function applies
    to it) gets Â = 0, as in TRL 1.16: it moves nothing, and the others' baselines leave it out. (grpo.py's has
    the other advantages; this file's one row computes as its grpo row.)"""
    return group_advantages(rewards, num_generations).nan_to_num(0.0)


def kl_estimators(logprobs, ref_logprobs, mask):
    """Per-token estimators of KL[π_θ ‖ π_ref] on tokens sampled from π_θ (Schulman 2020, "Approximating
    KL divergence"), with log r = log π_ref − log π_θ:
        k1 = −log r = log π_θ − log π_ref          (unbiased, can be negative per token)
        k3 = (r − 1) − log r                        (unbiased, never negative)
    Returns (k1, k3), zero on padding."""
    log_r = ref_logprobs - logprobs
    return -log_r * mask, (log_r.exp() - 1 - log_r) * mask


def clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high):
    """PPO's clipped surrogate per token, negated to be minimized, with DAPO's separate upper bound
    (clip-higher, Yu et al. 2025; epsilon_high = epsilon_low is PPO's):

        l_t = −min( ρ_t Â, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â ),   ρ_t from importance_ratio (GSPO: s_i)

    `advantages` has one value per completion, broadcast over its tokens."""
    advantages = advantages.unsqueeze(1)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages)


def clipped_tokens(ratio, advantages, epsilon_low, epsilon_high):
    """(low, high): where the clip is active on each side. The clipped surrogate cuts a token's gradient when ρ_t
    falls below 1 − ε_low with Â < 0 (low) or rises above 1 + ε_high with Â > 0 (high); out of the band on the
    other side, min() keeps the unclipped term. As TRL counts them (grpo.py's clipped surrogate row)."""
    advantages = advantages.unsqueeze(1)
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def aggregate_loss(per_token_loss, mask, loss_type, num_sequences, num_tokens, max_completion_length):
    """The per-token losses l_it of a minibatch as one number, over the policy's tokens (`mask`):

        grpo      (1/B) Σ_i (1/|o_i|) Σ_t l_it     mean over each episode, then over episodes (eq. 3)
        dapo      Σ_i Σ_t l_it / N                 every policy token of the rollout weighs the same (Yu et al. 2025)
        dr_grpo   Σ_i Σ_t l_it / (B · L_max)       a constant normalizer: no length bias (Liu et al. 2025)

    B = `num_sequences` episodes in the minibatch; N = `num_tokens`, the rollout's tokens ÷ its minibatches,
    as TRL 1.16; L_max = `max_completion_length`. Each row computes as grpo.py's of the same name."""
    summed = (per_token_loss * mask).sum(1)
    if loss_type == "grpo":
        return (summed / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "dapo":
        return summed.sum() / num_tokens
    if loss_type == "dr_grpo":
        return summed.sum() / (num_sequences * max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}")


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
    settle_lengths(args, {"max_completion_length": (256, None), "max_prompt_length": (64, 512)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    for name, least in {"num_iterations": 1, "num_generations": 2, "mini_batch_size": 1, "batch_size": 1,
                        "ppo_epochs": 1, "max_completion_length": 1, "max_prompt_length": 1, "eval_every": 1,
                        "eval_size": 0}.items():
        if getattr(args, name) is not None and getattr(args, name) < least:  # None: settled later
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        sys.exit(f"error: --max-tool-calling-iterations {args.max_tool_calling_iterations}: 0 or more (0: no calls "
                 "run)")
    if args.max_tool_calling_iterations == 0:  # TRL's meaning, and the baseline without tools: said, not silent
        print("note: --max-tool-calling-iterations 0: no call runs, so no tool is learned (leave it out for no limit)")
    for name, rule in {"lr": ">= 0", "max_grad_norm": "> 0", "temperature": "> 0", "beta": ">= 0", "epsilon": "> 0",
                       "epsilon_high": "> 0", "tool_timeout": "> 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")
    if args.loss_type not in ("grpo", "dapo", "dr_grpo"):  # grpo.py's and scale/grpo.py's have the others
        sys.exit(f"error: --loss-type {args.loss_type!r}: choose one of grpo, dapo, dr_grpo")
    if args.batch_size % args.num_generations or args.batch_size % args.mini_batch_size:
        sys.exit(f"error: --batch-size {args.batch_size} must split into groups of --num-generations "
                 f"{args.num_generations} and into minibatches of --mini-batch-size {args.mini_batch_size}")
    if args.dataset_name is not None and not (args.tools or args.environment):
        sys.exit("error: a dataset needs its tools: --tools my_tools.py:NAME,... or --environment my_env.py:CLASS")
    if args.dataset_name is not None and not (args.reward_fn or args.environment):
        sys.exit("error: a dataset needs a reward: --reward-fn exact_match, numeric_match or my_rewards.py:fn (or an "
                 "--environment's get_reward)")
    if args.tools and args.dataset_name is None and args.environment is None:  # it would train at reward 0
        sys.exit(f"error: --tools {' '.join(args.tools)} on the built-in task replaces the multiply its answers need; give your "
                 "tools your data (--dataset-name, --reward-fn) or an --environment")
    if args.environment and args.reward_num_workers:
        sys.exit(f"error: --reward-num-workers {args.reward_num_workers} with --environment: the reward functions read the "
                 "episodes' environment instances, which live in the trainer; leave it 0")
    if args.write_sft_data and args.environment not in (None, *BUILTIN_ENVIRONMENTS):
        sys.exit(f"error: --write-sft-data writes demonstrations of a built-in task ({', '.join(BUILTIN_ENVIRONMENTS)} "
                 f"or none), not of --environment {args.environment!r}")
    functions = len(args.reward_fn) or int(args.environment is None)  # the built-in task's exact_match
    if args.reward_weights and len(args.reward_weights) != functions:
        sys.exit(f"error: --reward-weights has {len(args.reward_weights)} values for {functions} reward functions "
                 "(one per --reward-fn, in order; an environment's get_reward weighs 1)")
    if not all(map(math.isfinite, (args.missing_eos_penalty, *args.reward_weights))):
        sys.exit(f"error: --missing-eos-penalty {args.missing_eos_penalty}, --reward-weights {list(args.reward_weights)}: "
                 "each must be a finite number")
    if args.reward_weights and not any(args.reward_weights) and not args.missing_eos_penalty and args.environment is None:
        sys.exit(f"error: --reward-weights {' '.join(map(str, args.reward_weights))}: every term weighs 0, so every "
                 "reward is 0 and nothing is learned; give a term a weight")


def load_episode_setup(args):
    """(tools, the environment's class and an instance or None, the reward terms (name, fn), their weights, the row
    maker of data without --dataset-name), each flag checked in one line before any model is loaded. The reward
    terms are --reward-fn's (exact_match on the built-in task) and, where the environment has get_reward(), TRL's
    one more of weight 1 named after its class; without a dataset, the rows are a built-in task's or TRL's empty
    prompts of dataset-free training (reset writes the prompt)."""
    tools = load_tools(args.tools) if args.tools else {}
    environment = load_environment(args.environment, tools) if args.environment else None
    if environment is None and not tools:
        tools = {"multiply": multiply}  # the built-in task's calculator
    has_reward = environment is not None and hasattr(environment[1], "get_reward")
    if environment is not None and not args.reward_fn and not has_reward:
        sys.exit(f"error: --environment {args.environment!r}: {environment[0].__name__} has no get_reward(), so there "
                 "is no reward; pass --reward-fn (TRL: a reward source is needed)")
    functions = load_reward_functions(args.reward_fn or ("exact_match",) * (environment is None), BUILTIN_REWARDS,
                                      args.format_pattern)
    weights = args.reward_weights or (1.0,) * len(functions)
    if has_reward:
        functions, weights = functions + [(environment[0].__name__, environment_reward)], (*weights, 1.0)
    task_row = (tool_task_row if environment is None else hunt_task_row if args.environment in BUILTIN_ENVIRONMENTS
                else lambda rng: {"prompt": [{"role": "user", "content": ""}]})
    return tools, environment, functions, weights, task_row


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    if args.write_sft_data:
        return write_demonstrations(args.write_sft_data, args.seed, hunt_demonstration if args.environment else
                                    demonstration)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    tools, environment, functions, weights, task_row = load_episode_setup(args)  # the flags of the episodes
    guard, tool_worker = reward_guard(functions, args), Worker(tools, TOOL_MEMORY) if tools else None  # forked now
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    G, B = args.num_generations, args.batch_size
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the sampling
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # Prompts and their columns, the tools' schemas, the models, and a template that can carry an episode
    train_rows, eval_rows = load_data(args, task_row, 50_000, [("prompt",)], "needs a `prompt` column")
    check_reward_signatures(functions, sorted(train_rows[0]) + ["environments"] * bool(environment))
    if environment:
        check_environment(environment[1], train_rows[0])
    schemas = tool_schemas(tools | (environment_tools(environment[1]) if environment else {}))
    tokenizer, stop_ids, policy, ref = load_models(args, device)
    check_tool_template(tokenizer, schemas, stop_ids, args.model_name_or_path)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, train_ids = tokenize_tool_prompts(tokenizer, train_rows, schemas, args.max_prompt_length, "train")
    if len(train_ids) < B // G:
        sys.exit(f"error: {len(train_ids)} training prompts fit --max-prompt-length {args.max_prompt_length}, fewer "
                 f"than the {B // G} of a batch; raise it (the tools' schemas are in every prompt) or lower --batch-size")
    eval_rows, eval_ids = tokenize_tool_prompts(tokenizer, eval_rows, schemas, args.max_prompt_length, "eval")
    positions, longest = model_positions(policy), max(len(ids) for ids in train_ids + eval_ids)
    settle_room(args, "max_completion_length", 512, "TRL's max_completion_length", (positions or math.inf) - longest)
    if positions is not None and longest + args.max_completion_length > positions:
        sys.exit(f"error: the longest prompt ({longest} tokens) + --max-completion-length {args.max_completion_length} "
                 f"exceeds the model's {positions} positions; lower --max-prompt-length or --max-completion-length")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{1 + (ref is not None)} model(s) in memory; tools: {', '.join(s['function']['name'] for s in schemas)}")
    terms = RewardTerms(functions, weights, None, [name for name, _ in functions], guard)
    harness = Harness(tokenizer, tools, schemas, stop_ids, positions,
                      *((environment[0], [environment[1]]) if environment else ()), worker=tool_worker)

    def logprobs_of(model, sequences, attention_mask, context_length):
        """(log π(a_t | s_t), entropy) of every completion token, the environment's too (the mask drops them), a
        minibatch at a time: in a rollout these are exactly the update's forward passes."""
        return forward_in_chunks(lambda s, a: policy_logprobs(model, s, a, context_length, args.temperature),
                                 args.mini_batch_size, sequences, attention_mask)

    # ---- the loop: an evaluation before any update, then sample, advantages, update and log each iteration -----
    evaluate(policy, harness, eval_rows, eval_ids, terms, amp, writer, 0, args)
    rng, start_time = random.Random(args.seed), time.time()  # rng: the prompts drawn
    progress = Progress(args.num_iterations, "iterations", args.progress)
    for iteration in range(1, args.num_iterations + 1):
        lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr
        optimizer.param_groups[0]["lr"] = lr
        # ---- 1. sample episodes: G of each prompt, the tools run between turns, and their rewards ------------
        policy.eval()
        with torch.no_grad(), amp():
            chosen = [i for i in rng.sample(range(len(train_ids)), B // G) for _ in range(G)]
            batch = sample_episodes(policy, harness, [train_rows[i] for i in chosen], [train_ids[i] for i in chosen],
                                    terms, args)
            # ---- 2. advantages within each group, and the policy the update starts from (on every token) ---
            advantages = compute_advantages(batch.rewards, G)
            old = old_policy(policy, ref, batch, logprobs_of, args)

        # ---- 3. update: μ passes over the rollout in shuffled minibatches, on the policy's tokens only --------
        policy.train()
        stats = {k: 0.0 for k in ("policy_loss", "kl_penalty", "clipped_low", "clipped_high", "policy_entropy")}
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(B, device=device) if epoch > 0 else torch.arange(B, device=device)
            for start in range(0, B, args.mini_batch_size):
                mb = order[start : start + args.mini_batch_size]
                with amp():
                    logprobs, entropy = policy_logprobs(policy, batch.sequences[mb], batch.attention_mask[mb],
                                                        batch.context_length, args.temperature)
                ratio = torch.exp(logprobs - old.logprobs[mb])  # ρ_t = π_θ / π_old, per token
                per_token = clipped_surrogate(ratio, advantages[mb], args.epsilon, epsilon_high)
                policy_loss = aggregate_loss(per_token, batch.loss_mask[mb], args.loss_type, args.mini_batch_size,
                                             batch.num_tokens, args.max_completion_length)
                kl_penalty = kl_to_reference(logprobs, old.ref_logprobs, batch.loss_mask, mb, batch.num_tokens,
                                             args.max_completion_length, args)
                (policy_loss + kl_penalty).backward()
                accumulate_grpo_stats(stats, policy_loss, kl_penalty, ratio,
                                      clipped_tokens(ratio, advantages[mb], args.epsilon, epsilon_high), batch.mask[mb],
                                      (entropy.detach() * batch.loss_mask[mb]).sum(), epoch == start == 0)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                check_finite(iteration, loss=policy_loss + kl_penalty, grad_norm=grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        # ---- 4. log: statistics of the whole batch, the policy's tokens and the tools' apart ----------------
        log_agent_iteration(writer, iteration, batch, old, stats, terms, lr, start_time, args)
        progress(iteration, f"reward {float(batch.rewards.nanmean()):.3f}")
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            evaluate(policy, harness, eval_rows, eval_ids, terms, amp, writer, iteration, args)

    save_model(policy, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


# ---------------------------------------------------------------------------------------------
# Tools: Python functions the policy calls, as TRL's tools=. The chat template renders their JSON schemas (from
# type hints and the docstring: transformers.utils.get_json_schema) and the calls; a turn is parsed as TRL's
# parse_response parses it (typed by the schemas); each call runs with a timeout, and whatever goes wrong becomes
# its result {"error": ...}, which the policy reads in the next turn. A tool turn's ids are the template's alone.
# ---------------------------------------------------------------------------------------------
def response_template_of(tokenizer, schemas, stop_ids):
    """The response template that reads this chat template's assistant turns (transformers' response parsing, which
    TRL's parse_response calls): the tokenizer's own where it has one (TRL's add_response_schema sets one for the
    templates it knows by their text); else one read off the template's rendering: the start anchor (the assistant's
    header, less a <think> the generation prompt pre-writes, which the prefix then opens), reasoning in <think> ...
    </think>, the calls in the format the template writes, Qwen2.5/Qwen3's <tool_call>{json}</tool_call> or
    Qwen3.5's <tool_call><function=NAME><parameter=KEY>value</parameter>... (as TRL's qwen3_template and
    qwen3_5_template), and the content up to the end of turn. None where it writes calls in neither format."""
    if getattr(tokenizer, "response_template", None) is not None:
        return tokenizer.response_template
    user = [{"role": "user", "content": "probe"}]
    text = lambda messages, **kw: tokenizer.decode(render_chat(tokenizer, messages, tools=schemas, **kw))  # noqa: E731
    anchor = text(user, add_generation_prompt=True)[len(text(user)) :].split("<think>")[0]
    call = {"type": "function", "function": {"name": schemas[0]["function"]["name"], "arguments": {"x": 1}}}
    written = text(user + [{"role": "assistant", "content": "", "tool_calls": [call]}])
    if "<function=" in written:  # Qwen3.5's: each argument written as text, typed by the tool's schema
        calls = {"open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>", "content": "xml-inline",
                 "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                                  "value_parser": {"name": "text"}},
                 "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}
    elif "<tool_call>" in written:
        calls = {"open": "<tool_call>", "content": "json", "transform": {"type": "function", "function": "{content}"}}
    else:
        return None
    end_of_turn = "|".join(re.escape(tokenizer.decode([t])) for t in stop_ids)
    return {"defaults": {"role": "assistant"}, "start_anchor": anchor, "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {**calls, "close_pattern": r"</tool_call>\s*", "repeats": True},
        "content": {"close_pattern": rf"(?:{end_of_turn})\s*", "content": "text"}}}


def parse_turn(tokenizer, ids, prefix, schemas):
    """The assistant message of a sampled turn's ids as TRL's parse_response reads it: transformers' parse_response
    with the tokenizer's response template (response_template_of), anchored at the context the turn continues
    (`prefix`: the prompt and the episode so far, so that a <think> the generation prompt pre-wrote opens the
    turn's reasoning, kept as `reasoning_content`), each call's arguments typed by its tool's schema ("12" is 12
    for an integer parameter). A turn it cannot parse (a call that is not JSON, or is cut short) is its text with
    no calls, TRL's fallback: the episode ends with it. The ids are decoded to read the calls, never to train on."""
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=schemas)
        for call in (message or {}).get("tool_calls") or []:  # TRL's checks: a name; no arguments are {}
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
                    or not isinstance(call["function"].get("name"), str):
                raise ValueError("a call without a function's name")
            call["function"]["arguments"] = call["function"].get("arguments") or {}
        if message is None:
            raise ValueError("nothing parsed")
    except (ValueError, TypeError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    content = message.get("content")
    return {**message, "content": content.removesuffix(tokenizer.eos_token) if isinstance(content, str) else ""}


def call_tool(tools, call, timeout, worker=None):
    """(the result as a tool turn's content, whether the call failed) of one call, as TRL's tool loop writes it:
    str() of the function's return value; for an unknown tool, arguments the function does not take, or an
    exception it raises, str({"error": message}) with TRL's message ("Tool NAME not found.", the exception's
    text). Unlike TRL's, a --tools function runs in `worker`, a process of its own: a call that takes longer than
    `timeout` seconds, dies, or allocates past TOOL_MEMORY fails, the worker killed (what it started too) and
    replaced. An environment's methods hold its episode's state, so they run in the trainer: one past `timeout` fails
    and is left to finish in a daemon thread (Python cannot stop it). A list result is text (TRL passes a list on as
    multimodal content)."""
    function, outcome = call["function"], {}
    if function["name"] not in tools:
        outcome["error"] = f"Tool {function['name']} not found."
    elif worker is not None and tools[function["name"]] is worker.table.get(function["name"]):
        worker.send(function["name"], function["arguments"])
        status, value = worker.result(time.monotonic() + timeout)
        if status == "ok":
            outcome["result"] = value
        elif status == "raised":  # TRL's message: the exception's text
            outcome["error"] = value[1] or value[0]
        else:
            outcome["error"] = f"timed out after {timeout:g} s" if status == "timeout" else value
    else:
        def run():
            try:
                outcome["result"] = tools[function["name"]](**function["arguments"])
            except Exception as e:  # noqa: BLE001  the tool's failure is the policy's to read
                outcome["error"] = str(e)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
        if not outcome:
            outcome["error"] = f"timed out after {timeout:g} s"
    if "error" in outcome:
        return str({"error": outcome["error"]}), True
    return str(outcome["result"]), False


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


def import_source(flag, spec, source):
    """The namespace of a .py file (by path) or an importable module, for --tools and --environment; what cannot be
    found or imported is one line."""
    if source.endswith(".py") and not os.path.isfile(source):
        sys.exit(f"error: {flag} {spec!r}: the file {source!r} does not exist")
    if not source.endswith(".py") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module of the directory the run starts in
    try:
        return runpy.run_path(source) if source.endswith(".py") else vars(importlib.import_module(source))
    except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
        sys.exit(f"error: {flag} {spec!r}: importing {source!r} failed: {type(e).__name__}: {first_line(e)}")


def check_schema(flag, spec, name, fn):
    """One line where a tool has no JSON schema (a type hint or its docstring's description of an argument missing)."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(fn)
    except Exception as e:  # noqa: BLE001  transformers' own exceptions for a missing hint or docstring
        sys.exit(f"error: {flag} {spec!r}: {name}: {first_line(e).rstrip('.!')}; a tool needs type hints and a "
                 "docstring whose Args section describes each argument (its JSON schema), as TRL's tools")


def load_tools(specs):
    """{name: function} of --tools MODULE_OR_FILE:NAME[,NAME...], each a function in a .py file (by path) or an
    importable module, as --reward-fn loads them. What cannot be found or imported, or a function without type
    hints or a docstring for its arguments (no JSON schema to render), is one line, before any model is loaded."""
    tools = {}
    for spec in specs:
        source, _, names = spec.rpartition(":")
        if not source or not names:
            sys.exit(f"error: --tools {spec!r}: name your functions as MODULE_OR_FILE:NAME[,NAME...] (e.g. "
                     "my_tools.py:search,lookup)")
        namespace = import_source("--tools", spec, source)
        for name in names.split(","):
            if not callable(namespace.get(name)):
                sys.exit(f"error: --tools {spec!r}: {source!r} has no function {name!r}")
            check_schema("--tools", spec, name, namespace[name])
            if name in tools:
                sys.exit(f"error: --tools: {name!r} is given twice")
            tools[name] = namespace[name]
    return tools


def load_environment(spec, tools):
    """(the class, an instance) of --environment, TRL's environment_factory: a built-in's name (treasure_hunt) or
    MODULE_OR_FILE:Class. One line, before any work, where it does not load or construct, lacks `reset`, has no
    tool (a public method), a tool without type hints or a docstring, one named as a --tools function, or a
    `get_reward` that is not a method."""
    if spec in BUILTIN_ENVIRONMENTS:
        cls = BUILTIN_ENVIRONMENTS[spec]
    else:
        source, _, name = spec.rpartition(":")
        if not source or not name:
            sys.exit(f"error: --environment {spec!r}: name a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}) or a class "
                     "of yours as MODULE_OR_FILE:CLASS (e.g. my_env.py:Wordle)")
        cls = import_source("--environment", spec, source).get(name)
        if not inspect.isclass(cls):
            sys.exit(f"error: --environment {spec!r}: {source!r} has no class {name!r}")
    if not inspect.isfunction(getattr(cls, "reset", None)):
        sys.exit(f"error: --environment {spec!r}: {cls.__name__} has no reset(self, **row) method, which starts each "
                 "episode (TRL's environment_factory)")
    if getattr(cls, "get_reward", None) is not None and not inspect.isfunction(cls.get_reward):
        sys.exit(f"error: --environment {spec!r}: {cls.__name__}.get_reward must be a method get_reward(self) -> float")
    try:
        instance = cls()
    except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
        sys.exit(f"error: --environment {spec!r}: {cls.__name__}() raised {type(e).__name__}: {first_line(e)}")
    methods = environment_tools(instance)
    if not methods:
        sys.exit(f"error: --environment {spec!r}: {cls.__name__} has no public method, no tool for the policy to call")
    for name, method in methods.items():
        check_schema("--environment", spec, name, method)
        if name in tools:
            sys.exit(f"error: --environment {spec!r}: its tool {name!r} is also a --tools function; rename one")
    return cls, instance


def environment_tools(instance):
    """{name: bound method} of an environment's tools: its public methods but reset and get_reward, as TRL's."""
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


def check_environment(instance, row):
    """The environment tried on the first training row before any work, one line for each failure: reset(**row)
    must run and return None or text, and get_reward(), where there is one, a number."""
    name = type(instance).__name__
    try:
        observation = instance.reset(**row)
    except Exception as e:  # noqa: BLE001  the user's code: whatever it raises is one line
        sys.exit(f"error: --environment: {name}.reset(**row) raised {type(e).__name__}: {first_line(e)} (it is given "
                 f"every column of a row: {sorted(row)})")
    if observation is not None and not isinstance(observation, str):
        sys.exit(f"error: --environment: {name}.reset returned {observation!r}: None or text (appended to the last user "
                 "message), as TRL's")
    if hasattr(instance, "get_reward"):
        try:
            reward = instance.get_reward()
        except Exception as e:  # noqa: BLE001
            sys.exit(f"error: --environment: {name}.get_reward() raised {type(e).__name__}: {first_line(e)} after reset")
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            sys.exit(f"error: --environment: {name}.get_reward() returned {reward!r}: it must return a finite number")


def tool_schemas(tools):
    """The JSON schema of each tool, as the chat template renders them (TRL's tools= and sft.py's `tools` column)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools.values()]


def check_tool_template(tokenizer, schemas, stop_ids, path):
    """One line, before any work, where the chat template of the model at `path` cannot carry an episode: it does
    not render the tools, a call or a tool's result, it renders a tool turn so that the turn's ids cannot continue
    the sampled ones (tool_turn_ids), or it writes calls in a format no response template reads; else the
    tokenizer gets its response template (response_template_of)."""
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
    tokenizer.response_template = response_template_of(tokenizer, schemas, stop_ids)
    if tokenizer.response_template is None:
        sys.exit(f"{hint} writes tool calls in neither Qwen2.5's <tool_call>{{json}}</tool_call> nor Qwen3.5's "
                 "<function=NAME> format; set the tokenizer's response_template (transformers' response parsing)")


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
    1 call in 10 with an argument misnamed (its error, then the call again), 1 in 10 with a digit of a factor changed (a wrong
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
            if rng.random() < 0.1:  # an argument misnamed: the tool's error, then the call again
                slip = {"type": "function", "function": {"name": "multiply", "arguments": {"a": result, "c": factor}}}
                error, _ = call_tool({"multiply": multiply}, slip, 1.0)
                messages += [{"role": "assistant", "content": "", "tool_calls": [slip]},
                             {"role": "tool", "name": "multiply", "content": error}]
            a = int(str(result)[::-1]) if rng.random() < 0.1 and str(result)[0] != str(result)[-1] else result
            result = multiply(a, factor)
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": factor}}}]},
                {"role": "tool", "name": "multiply", "content": str(result)}]
        messages.append({"role": "assistant", "content": str(result)})
    return {"messages": messages, "tools": tool_schemas({"multiply": multiply})}


def write_demonstrations(path, seed, demonstration, n=20_000):
    """--write-sft-data: n demonstrations of a built-in task (`demonstration` makes one, from a random stream of
    their own) to a .jsonl file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in task_rows(seed, "sft", n, demonstration))
    print(f"wrote {n:,} demonstrations of the built-in tool task to {path}")


# ---------------------------------------------------------------------------------------------
# The built-in stateful task (--environment treasure_hunt): the state is the point. Each episode's instance
# hides a chain of rooms; the prompt names the first; look(room) reads the note there, which names the next
# room or the chest's code; unlock(code) tries it, once, and the answer is the code tried. The policy sees only
# what its calls reveal, so an episode needs two or three calls, each on the result of the last; without the
# environment the code is a guess (1 in 9,000). get_reward() is 1 where the chest was opened: the gold reward.
# ---------------------------------------------------------------------------------------------
class TreasureHunt:
    """A chain of rooms with a chest at its end, as an environment_factory class: reset(**row) takes the row's
    `start` and `rooms` ([name, note] pairs); the public methods are the tools; get_reward() scores the episode."""

    def reset(self, start, rooms, **row):
        self.notes, self.code = {int(name): note for name, note in rooms}, int(rooms[-1][1].split()[-1])
        self.calls, self.opened, self.tried = 0, False, False
        return f" Start in {start}."

    def look(self, room: int) -> str:
        """Read the note in a room: the next room to go to, or the chest's code.

        Args:
            room: the room's number
        """
        self._count()
        if room not in self.notes:
            raise ValueError(f"there is no room {room!r}")
        return self.notes[room]

    def unlock(self, code: int) -> str:
        """Try a code on the chest: one try only.

        Args:
            code: the chest's four-digit code
        """
        self._count()
        if self.tried:
            raise ValueError("the chest was tried already")
        self.tried, self.opened = True, code == self.code
        return f"{'opened' if self.opened else 'locked'} {code}"

    def get_reward(self) -> float:
        return float(self.opened)

    def _count(self):
        self.calls += 1
        if self.calls > 6:  # the budget: a policy that wanders is stopped
            raise ValueError("out of moves")


BUILTIN_ENVIRONMENTS = {"treasure_hunt": TreasureHunt}

def hunt_task_row(rng):
    """A row of the treasure hunt: rooms numbered 10 to 99 from `start`, its note `code NNNN` or `go to ROOM`
    whose note is the code (two calls or three, with unlock), and its `target`, the code, as text."""
    names, code = [str(n) for n in rng.sample(range(10, 100), rng.randint(1, 2))], rng.randint(1000, 9999)
    rooms = [[a, f"go to {b}"] for a, b in zip(names, names[1:])] + [[names[-1], f"code {code}"]]
    return {"prompt": [{"role": "user", "content": "Open the chest."}], "start": names[0], "rooms": rooms,
            "target": str(code)}


def hunt_demonstration(rng):
    """A row of sft.py's data for the treasure hunt, a sloppy demonstrator's episode in TRL's format: it looks in
    each room of the chain and unlocks with the code, slipping as the multiplication demonstrator does: 1 look in
    10 in a miscopied room (its error, then the right one), 1 code in 10 with a digit changed (locked), 1 episode
    in 10 a guessed code without a look."""
    row, env = hunt_task_row(rng), TreasureHunt()
    messages = [{**row["prompt"][0], "content": row["prompt"][0]["content"] + env.reset(**row)}]

    def step(name, **arguments):
        content, _ = call_tool(environment_tools(env), {"type": "function", "function": {"name": name,
                                                                                        "arguments": arguments}}, 1.0)
        messages.extend([{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "name": name, "content": content}])
        return content

    note = "code " + str(rng.randint(1000, 9999))  # the guess, where it does not look
    if rng.random() >= 0.1:
        room = int(row["start"])
        while True:
            if rng.random() < 0.1:  # a room miscopied: its error, then the right one
                step("look", room=next(n for n in (room + 1, room - 1, room + 2) if n not in env.notes))
            note = step("look", room=room)
            if not note.startswith("go to "):
                break
            room = int(note.split()[-1])
    code = note.split()[-1]
    if rng.random() < 0.1:  # a digit changed
        code = code[:3] + str((int(code[3]) + rng.randint(1, 9)) % 10)
    step("unlock", code=int(code))
    messages.append({"role": "assistant", "content": code})  # the answer: the code tried, copied from the result
    return {"messages": messages, "tools": tool_schemas(environment_tools(env))}


@dataclass
class Harness:
    """What an episode runs in: the tokenizer and its chat template, the --tools by name, the schemas of every tool
    (the environment's too), the stop ids, the model's positions, and --environment's class and its pool of instances."""
    tokenizer: object
    tools: dict
    schemas: list
    stop_ids: list
    positions: int | None = None
    environment: type | None = None
    pool: list = field(default_factory=list)  # the environment's instances, one per episode of a batch
    said: set = field(default_factory=set)  # the notes printed (note_once)
    worker: object = None  # the Worker, the process the --tools functions run in (call_tool); None: in the trainer


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
    environments: list | None  # each episode's environment instance, in its state at the episode's end


def reset_environments(harness, rows, max_prompt_length):
    """One instance of the environment per episode, from a pool grown as needed ("construct once, reset often", as
    TRL's), each reset(**row) with its episode's row: the text it returns is appended to the last user message (TRL's
    rule), so the G episodes of a prompt each have their own state. Returns (prompts, their ids, the instances)."""
    while len(harness.pool) < len(rows):
        harness.pool.append(harness.environment())
    prompts = []
    for row, instance in zip(rows, harness.pool):
        observation, prompt = instance.reset(**row), row["prompt"]
        prompts.append(prompt if observation is None else
                       prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}])
    ids = [render_chat(harness.tokenizer, p, add_generation_prompt=True, tools=harness.schemas) for p in prompts]
    if max(map(len, ids)) > max_prompt_length:
        sys.exit(f"error: a prompt with its reset's text is {max(map(len, ids))} tokens, over --max-prompt-length "
                 f"{max_prompt_length}; raise it. Stopped, nothing saved")
    return prompts, ids, harness.pool[: len(rows)]


def run_episodes(policy, harness, prompt_ids, prompts, tools, args, greedy=False):
    """Each prompt's episode, all at once: sample a turn for every episode still going (`generate`, one batch),
    parse its calls (parse_turn), run them with the episode's `tools`, append the tool turn's ids (tool_turn_ids)
    and go on, until a turn calls no tool, has no stop token (cut at --max-completion-length tokens after the
    prompt), or --max-tool-calling-iterations rounds are done. TRL's rule for the length: a tool turn that would take
    the episode past --max-completion-length (or the prompt past the model's positions) is dropped and the episode
    ends; one that fills it exactly is kept, and the episode ends with it. A tool turn the template cannot render so
    that it continues the sampled ids is refused (said once), ending its episode. Returns per episode its turns
    [(ids, sampled, logprobs)], its messages after the prompt, and its counts (calls, failures, turns, tool tokens)."""
    turns, conversations = [[] for _ in prompt_ids], [[] for _ in prompt_ids]
    counts = [[0, 0, 0, 0] for _ in prompt_ids]  # calls, failed calls, the policy's turns, the environment's tokens
    used, going, rounds = [0] * len(prompt_ids), list(range(len(prompt_ids))), 0  # used: tokens after the prompt
    while going:
        contexts = [prompt_ids[b] + [t for ids, _, _ in turns[b] for t in ids] for b in going]
        room = [args.max_completion_length - used[b] for b in going]
        sequences, _, width, response_mask, logprobs = generate(policy, contexts, harness.tokenizer.pad_token_id,
                                                                harness.stop_ids, max(room), args.temperature, greedy)
        still = []
        for row, b in enumerate(going):
            n = min(int(response_mask[row].sum()), room[row])  # a turn is cut at the episode's limit
            ids = sequences[row, width : width + n].tolist()
            turns[b].append((ids, True, logprobs[row, :n].tolist()))
            used[b], counts[b][2] = used[b] + n, counts[b][2] + 1
            message = parse_turn(harness.tokenizer, ids, contexts[row], harness.schemas)
            conversations[b].append(message)
            stopped = bool(ids) and ids[-1] in harness.stop_ids
            if not stopped or not message.get("tool_calls") or rounds == args.max_tool_calling_iterations:
                continue
            results = [call_tool(tools[b], call, args.tool_timeout, harness.worker) for call in message["tool_calls"]]
            counts[b][0] += len(results)
            counts[b][1] += sum(failed for _, failed in results)
            replies = [{"role": "tool", "name": call["function"]["name"], "content": content}
                       for call, (content, _) in zip(message["tool_calls"], results)]
            suffix = tool_turn_ids(harness.tokenizer, prompts[b] + conversations[b], replies, harness.schemas,
                                   harness.stop_ids)
            if suffix is None:
                note_once(harness, "refused", "note: a tool turn the chat template renders so that its ids cannot "
                          "continue the sampled ones was refused: its episode ends there (now and whenever this happens)")
            elif used[b] + len(suffix) <= args.max_completion_length and (  # TRL's rule: a result past the limit ends it
                    harness.positions is None or len(contexts[row]) + n + len(suffix) < harness.positions):
                turns[b].append((suffix, False, None))
                conversations[b] += replies
                used[b], counts[b][3] = used[b] + len(suffix), counts[b][3] + len(suffix)
                if used[b] < args.max_completion_length:  # no room for a turn: it ends with the result
                    still.append(b)
        going, rounds = still, rounds + 1
    return turns, conversations, counts


def note_once(harness, key, line):
    """Print `line` the first time `key` happens in this run."""
    if key not in harness.said:
        print(line)
        harness.said.add(key)


def sample_episodes(policy, harness, rows, prompt_ids, terms, args, greedy=False):
    """The episodes of `prompt_ids` (run_episodes), each in its own instance of --environment where there is one
    (reset_environments: its prompt then has the reset's text), as the update's tensors (episode_tokens), and their
    rewards."""
    prompts, environments = [row["prompt"] for row in rows], None
    if harness.environment is not None:
        prompts, prompt_ids, environments = reset_environments(harness, rows, args.max_prompt_length)
    tools = [harness.tools | environment_tools(e) for e in environments] if environments else [harness.tools] * len(rows)
    turns, conversations, counts = run_episodes(policy, harness, prompt_ids, prompts, tools, args, greedy)
    episodes = [episode_tokens(t) for t in turns]
    width, length, device = max(map(len, prompt_ids)), max(len(ids) for ids, _, _ in episodes), policy.device
    pad = harness.tokenizer.pad_token_id
    sequences = torch.tensor([[pad] * (width - len(p)) + p + ids + [pad] * (length - len(ids))
                              for p, (ids, _, _) in zip(prompt_ids, episodes)], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(ids)) + [0] * (length - len(ids))
                                   for p, (ids, _, _) in zip(prompt_ids, episodes)], device=device)
    mask, sampler_logprobs = (torch.tensor([e[k] + [0.0] * (length - len(e[k])) for e in episodes], device=device)
                              for k in (1, 2))
    has_stop = torch.tensor([bool(t[-1][0]) and t[-1][0][-1] in harness.stop_ids for t in turns], device=device)
    rewards, table = episode_rewards(rows, prompts, conversations, has_stop, terms, environments, args)
    loss_mask = mask * has_stop.unsqueeze(1) if args.mask_truncated_completions else mask
    num_tokens = max(1.0, loss_mask.sum().item()) * args.mini_batch_size / len(rows)  # each token weighs the same
    return Episodes(sequences, attention_mask, width, mask, rewards, table, has_stop, sampler_logprobs, loss_mask,
                    num_tokens, conversations, torch.tensor(counts, dtype=torch.float), environments)


def episode_rewards(rows, prompts, conversations, has_stop, terms, environments, args):
    """The reward of each episode, r = Σ_k w_k r_k over the reward terms (combine_rewards): the reward functions,
    each given the prompts and the episodes' messages after them (TRL's completions of a tool run: the answer is the
    last message) and the rows' columns, with `environments` (the instances, as TRL's) where there are any, and the
    environment's get_reward() (environment_reward); --missing-eos-penalty for an episode whose last turn was cut at
    the length limit. Returns (rewards, the [B, K] table)."""
    columns = reward_columns(rows) | ({"environments": environments} if environments else {})
    table = reward_terms(terms.functions, prompts, conversations, columns, terms.guard)
    rewards = combine_rewards(table.to(has_stop.device), terms.weights)
    return torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty)), table


def environment_reward(prompts, completions, environments, **columns):
    """The environment's reward term, as TRL's: get_reward() of each episode's instance, from its state at the end."""
    return [instance.get_reward() for instance in environments]


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


def log_agent_iteration(writer, iteration, batch, old, stats, terms, lr, start_time, args):
    """An iteration's statistics of the whole batch, to TensorBoard (docs/tags.md), and a line every 10 iterations:
    the policy's tokens only (entropy, lengths, clipping, KL) and the tools' apart."""
    B, G, mask = args.batch_size, args.num_generations, batch.mask
    groups, tokens = batch.rewards.view(-1, G), mask.sum().item()
    sampler_diff = ((old.logprobs - batch.sampler_logprobs) * mask).abs()  # token-exact: the sampler's log-probs
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
        "rollout/logprob_diff_mean": sampler_diff.sum().item() / tokens,
        "rollout/logprob_diff_max": sampler_diff.max().item(),
    }
    if args.beta > 0:
        logs.update({"objective/kl": old.k1.sum().item() / B,
                     "losses/kl_penalty": stats["kl_penalty"] / num_minibatches})
    logs.update(term_means(batch.table, terms.names, "rewards/", "objective/score"))
    logs.update(terms.guard.counts())  # the completions whose reward call failed since the last log
    for tag, value in logs.items():
        writer.add_scalar(tag, float(value), iteration)
    if iteration % 10 == 0:
        print(f"iteration {iteration}: reward {logs['objective/reward']:.3f}, calls {logs['tools/call_count']:.2f} "
              f"(failed {logs['tools/failure_count']:.2f}) per episode, kl {logs.get('objective/kl', 0.0):.3f}, "
              f"{time.time() - start_time:.0f} s")


@torch.no_grad()
def evaluate(policy, harness, eval_rows, eval_ids, terms, amp, writer, iteration, args):
    """Episodes of the eval prompts, sampled at --temperature and greedy: their reward, calls and failures per
    episode and, on a built-in task, the gold accuracy (the answer is the product; the treasure hunt's chest is
    open). The first episodes go to TensorBoard as text with their masks; the first one is printed at the start and
    at the end, with its environment's state."""
    if not eval_ids:
        return
    policy.eval()
    logs = {}
    for suffix, greedy in (("", False), ("_greedy", True)):
        with amp():
            batch = sample_episodes(policy, harness, eval_rows, eval_ids, terms, args, greedy)
        if not greedy:
            logs["eval/reward"] = float(batch.rewards.nanmean())
            logs["eval/call_count"], logs["eval/failure_count"] = (float(c) for c in batch.counts[:, :2].mean(0))
            texts = [episode_text(harness.tokenizer, *(t[i] for t in (batch.sequences, batch.attention_mask,
                                                                          batch.mask)), batch.context_length)
                     for i in range(min(4, len(eval_ids)))]
            state = dict(vars(batch.environments[0])) if batch.environments else None
        if args.dataset_name is None and args.environment in (None, *BUILTIN_ENVIRONMENTS):  # a built-in task
            gold = (batch.table[:, -1].tolist() if args.environment else
                    exact_match(None, batch.conversations, [row["target"] for row in eval_rows]))
            logs[f"eval/gold_accuracy{suffix}"] = sum(gold) / len(gold)
    for tag, value in logs.items():
        writer.add_scalar(tag, value, iteration)
    writer.add_text("eval/episodes", "\n\n".join(f"    {t!r}" for t in texts), iteration)
    if iteration == 0:  # once: what the numbers are
        print(f"evaluation: {len(eval_ids):,} held-out episodes sampled at --temperature {args.temperature} (_greedy: the "
              f"argmax); eval/reward is the training reward (--missing-eos-penalty {args.missing_eos_penalty} included)"
              + ", eval/gold_accuracy the answer alone" * ("eval/gold_accuracy" in logs))
    print(f"iteration {iteration}: " + ", ".join(f"{tag} {value:.3f}" for tag, value in logs.items()))
    if iteration in (0, args.num_iterations):
        print(f"an episode (⟦the environment's tokens⟧, m = 0; the rest the policy's, m = 1):\n    {texts[0]!r}"
              + (f"\n  its environment's state at the end: {state}" if state is not None else ""))
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
    their weights, the name of each term (the reward model's "reward_model"), and the functions' RewardGuard."""
    functions: list
    weights: tuple
    reward: torch.nn.Module | None
    names: list
    guard: object  # the RewardGuard: how the reward functions are called, and their failures


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
TOOL_MEMORY = 4 << 30  # bytes of address space a --tools call may add to its worker's (call_tool)


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


# ---------------------------------------------------------------------------------------------
# Forward passes and sampling
# ---------------------------------------------------------------------------------------------
def position_ids_of(attention_mask):
    """Positions count real tokens only, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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
