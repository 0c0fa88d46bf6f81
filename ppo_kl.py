"""PPO with the adaptive KL penalty instead of clipping, for discrete actions and vector observations.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), section 4:
maximize the KL-penalized surrogate (eq. 8)

    L^KLPEN(θ) = Ê_t[ r_t(θ) Â_t − β KL[π_old(·|s_t), π_θ(·|s_t)] ]

with the KL computed exactly between the two categorical distributions (the rollout stores the old
logits), and after each update adapt β toward the target KL d_targ:
    d = Ê_t[KL];  d < d_targ/1.5 → β ← β/2;  d > 1.5·d_targ → β ← 2β.
Everything else (agent, GAE, value loss, entropy bonus, TensorBoard tags) is as in the clipped version,
ppo_clip.py, so that the two overlay in TensorBoard; so are the defaults but three: a learning rate of 1e-3,
not annealed, and 10 epochs per update, so that an update moves the policy far enough for the penalty to bind
(at ppo_clip.py's, updates are so small that β halves after nearly every one: below 1e-6 from update 21).

    python ppo_kl.py                                # CartPole-v1, 500k steps, adaptive β
    python ppo_kl.py --no-adaptive-kl --kl-beta 3   # fixed β
"""
import datetime
import os
import random
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, part of the run name runs/<env>__<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of python, numpy, torch and the environments"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    threads: int = 1
    """torch CPU threads; one is fastest for networks this small (more threads cost more in overhead than they save)"""
    progress: bool = True
    """on a terminal, a line every ~10 s: the steps done, their rate, the time left and the mean return of the
    last 100 episodes (--no-progress: none)"""
    save_model: bool = False
    """save the agent and the flags to runs/<run name>/<exp name>.pt (`torch.load(path)` reads it)"""
    eval_episodes: int = 10
    """episodes of the deterministic (argmax) evaluation at the end; 0 skips it"""
    load_model: str | None = None
    """start from this checkpoint (a .pt written by --save-model); with --total-timesteps 0, only evaluate it"""
    capture_video: bool = False
    """record the evaluation episodes to videos/<run name>/ (needs moviepy; pygame for classic control;
    MuJoCo without a display: MUJOCO_GL=egl)"""
    save_every: int = 0
    """write a checkpoint to resume from every this many iterations, to runs/<run name>/checkpoint-<iteration>.pt
    (0: none; SIGTERM always writes one, then ends the run)"""
    keep_checkpoints: int = 2
    """keep the last this many checkpoints, deleting older ones"""
    resume: str | None = None
    """resume from this checkpoint-<iteration>.pt, or from the latest in this runs/<run name> directory, with the
    flags of the run it continues (the episodes in progress at the save start over)"""

    env_id: str = "CartPole-v1"
    """gymnasium id of an environment with discrete actions and vector observations"""
    total_timesteps: int = 500_000
    """total environment steps, summed over all parallel environments"""
    learning_rate: float = 1e-3
    """Adam learning rate (rlhf_ppo.py: --lr). ppo_clip.py's 2.5e-4 (annealed) moves the policy by less than
    d_targ/1.5 per update, so β halves after nearly every update and is below 1e-6 from update 21; at 1e-3, constant,
    with 10 epochs, an update pushes against the penalty and β adapts (docs/ppo_kl.md)"""
    num_envs: int = 4
    """number of parallel environments"""
    num_steps: int = 128
    """steps per environment in each rollout (batch = num_envs * num_steps)"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0 over training (off here: updates that shrink to nothing would halve β
    to nothing)"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """λ of generalized advantage estimation (TRL, rlhf_ppo.py: lam)"""
    num_minibatches: int = 4
    """minibatches per epoch; must divide the batch (TRL: num_mini_batches; rlhf_ppo.py sets their size instead,
    --mini-batch-size = batch / num_minibatches)"""
    update_epochs: int = 10
    """epochs over the rollout in each update (TRL: num_ppo_epochs; rlhf_ppo.py: --ppo-epochs); 10 as in the
    paper's section 6.1 (ppo_clip.py: 4)"""
    norm_adv: bool = True
    """normalize advantages within each minibatch"""
    kl_target: float = 0.01
    """d_targ, the KL per update that the adaptive β aims at"""
    kl_beta: float = 1.0
    """β, the KL penalty coefficient: its initial value when adaptive, else fixed"""
    adaptive_kl: bool = True
    """adapt β after each update (section 4); --no-adaptive-kl keeps it fixed"""
    clip_coef: float = 0.2
    """ε of the value-loss clipping and of the clipfrac diagnostic; the policy loss is not clipped (TRL, rlhf_ppo.py:
    cliprange_value)"""
    clip_vloss: bool = True
    """clip the value loss around the old values, as in the OpenAI baselines"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus (c2 in eq. 9)"""
    vf_coef: float = 0.5
    """coefficient of the value loss (c1 in eq. 9)"""
    max_grad_norm: float = 0.5
    """clip the global gradient norm to this"""
    bootstrap_truncation: bool = True
    """on a time-limit truncation bootstrap from the value of the real final observation"""


# ---------------------------------------------------------------------------------------------
# The math: pure functions, checked against hand-computed values in tests/test_ppo_kl.py
# ---------------------------------------------------------------------------------------------
def compute_gae(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda):
    """Generalized advantage estimation over a rollout of shape [T, num_envs] (PPO eq. 11-12).

        δ_t = r_t + γ (1 − term_t) V_next_t − V(s_t)
        Â_t = δ_t + γλ (1 − done_t) Â_{t+1},            done_t = term_t or trunc_t
        R_t = Â_t + V(s_t)                               (the value target)

    V_next_t is the value of the state after step t: V(s_{t+1}) inside an episode, `last_value`
    after the last step of the rollout, and `final_values[t]`, the value of the real final
    observation, when the episode was truncated at step t. A time limit cuts the future off, it
    does not make it worth zero; a termination does, hence the (1 − term_t). Passing zeros as
    final_values treats truncations like terminations. Works on numpy arrays or torch tensors.
    Returns (advantages, returns).
    """
    num_steps = len(rewards)
    advantages = rewards * 0.0
    lastgaelam = 0.0
    for t in reversed(range(num_steps)):
        next_values = last_value if t == num_steps - 1 else values[t + 1]
        next_values = next_values * (1 - truncations[t]) + final_values[t] * truncations[t]
        delta = rewards[t] + gamma * (1 - terminations[t]) * next_values - values[t]
        not_done = (1 - terminations[t]) * (1 - truncations[t])
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * not_done * lastgaelam
    return advantages, advantages + values


def categorical_kl(old_logits, new_logits):
    """The exact KL between two categorical distributions given by logits, one value per state:

        KL[π_old(·|s) ‖ π_θ(·|s)] = Σ_a π_old(a|s) (log π_old(a|s) − log π_θ(a|s))
    """
    old_logp, new_logp = old_logits.log_softmax(-1), new_logits.log_softmax(-1)
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)


def kl_penalty_loss(ratio, advantages, kl, beta):
    """The KL-penalized surrogate (PPO eq. 8), negated to be minimized:

        L = −mean( r_t(θ) Â_t − β KL_t ),   r_t = π_θ(a|s) / π_old(a|s)
    """
    return -(ratio * advantages - beta * kl).mean()


def update_beta(beta, kl, kl_target):
    """The adaptive rule of PPO section 4, applied after each update with d = mean KL:

        d < d_targ / 1.5  →  β ← β / 2       (the policy moved too little: penalize less)
        d > d_targ · 1.5  →  β ← β · 2       (it moved too much: penalize more)
        otherwise β is unchanged
    """
    if kl < kl_target / 1.5:
        return beta / 2
    if kl > kl_target * 1.5:
        return beta * 2
    return beta


def value_loss(newvalues, oldvalues, returns, clip_coef, clip=True):
    """Squared error to the returns, optionally clipped around the rollout's values:

        L = ½ mean( max( (V − R)²,  (V_old + clip(V − V_old, −ε, ε) − R)² ) )    (clip)
        L = ½ mean( (V − R)² )                                                 (no clip)
    """
    unclipped = (newvalues - returns) ** 2
    if not clip:
        return 0.5 * unclipped.mean()
    clipped = (oldvalues + torch.clamp(newvalues - oldvalues, -clip_coef, clip_coef) - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped).mean()


# ---------------------------------------------------------------------------------------------
# The agent, the argument checks, the evaluation
# ---------------------------------------------------------------------------------------------
def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),  # near-uniform initial policy
        )

    def get_value(self, x):
        return self.critic(x).squeeze(-1)

    def get_action_and_value(self, x, action):
        """The update's pass: log π(a|s) of the rollout's actions, the entropy of π(·|s), and V(s) (and the logits)."""
        logits = self.actor(x)
        logp = logits.log_softmax(-1)  # log π(a|s) of every action a
        entropy = -(logp.exp() * logp).sum(-1)
        return action, logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy, self.get_value(x), logits

    def numpy_weights(self):
        """(actor, critic), each a list of (W, b) numpy arrays, for the rollout (act): views of the parameters
        on the CPU, a copy of them from a GPU."""
        return tuple([(m.weight.detach().cpu().numpy(), m.bias.detach().cpu().numpy()) for m in net if isinstance(m, nn.Linear)]
                     for net in (self.actor, self.critic))


def mlp(layers, x):
    """The Agent's networks in numpy: x ← tanh(x Wᵀ + b) at each hidden layer, x Wᵀ + b at the last."""
    for i, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if i < len(layers) - 1:
            x = np.tanh(x)
    return x


def act(weights, obs):
    """The rollout's step, in numpy: a ~ π(·|s), log π(a|s) and V(s) for a batch of observations (and the
    logits). The same function of the weights as Agent.get_action_and_value, to float32 rounding (~1e-7),
    so the first epoch's ratio is 1 to rounding. Why numpy: these networks are microseconds of arithmetic
    and the rollout runs them once per env step, where each torch operator costs several microseconds of
    dispatch (and, on a GPU, a copy each way) and a numpy call about one. The action by inverse CDF:
    the first a with u < P(A ≤ a), u uniform from numpy's global stream (seeded, and saved in checkpoints)."""
    actor, critic = weights
    logits = mlp(actor, obs)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))  # log-softmax
    cdf = np.exp(logp).cumsum(-1)
    u = np.random.random((len(obs), 1)) * cdf[:, -1:]  # × the last entry (1 to rounding): u < it, so a < n
    action = (cdf <= u).sum(-1)
    return action, np.take_along_axis(logp, action[:, None], -1)[:, 0], mlp(critic, obs)[:, 0], logits


def check_args(args):
    """Flags that would crash, train nothing or fail at the end are one-line errors, before any work.
    Returns (batch_size, minibatch_size, num_iterations)."""
    for flag, value, least in (("--num-envs", args.num_envs, 1), ("--num-steps", args.num_steps, 1),
                               ("--num-minibatches", args.num_minibatches, 1), ("--update-epochs", args.update_epochs, 1),
                               ("--threads", args.threads, 1), ("--seed", args.seed, 0),
                               ("--total-timesteps", args.total_timesteps, 0), ("--eval-episodes", args.eval_episodes, 0)):
        if value < least:
            sys.exit(f"error: {flag} {value}: it must be at least {least}")
    # the algorithm's numbers
    rules = {"learning_rate": "> 0", "clip_coef": "> 0", "max_grad_norm": "> 0", "kl_target": "> 0", "kl_beta": ">= 0",
             "ent_coef": ">= 0", "vf_coef": ">= 0", "gamma": "in [0, 1]", "gae_lambda": "in [0, 1]"}
    for name, rule in rules.items():
        value = getattr(args, name)
        within = {"> 0": value > 0, ">= 0": value >= 0, "in [0, 1]": 0 <= value <= 1, "": True}[rule]
        if not (np.isfinite(value) and within):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}".rstrip())
    if not args.exp_name or "/" in args.exp_name or "\\" in args.exp_name:
        sys.exit(f"error: --exp-name {args.exp_name!r} names a directory (runs/<env>__<exp>__<seed>__<time>): "
                 "it must be non-empty, without '/' or '\\'")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        sys.exit(f"error: the batch (num_envs * num_steps = {batch_size}) does not divide into "
                 f"{args.num_minibatches} minibatches; change --num-minibatches")
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        sys.exit(f"error: minibatches of {minibatch_size} sample: --norm-adv divides the advantages by their std "
                 "over a minibatch, which needs at least 2; lower --num-minibatches or pass --no-norm-adv")
    num_iterations = args.total_timesteps // batch_size
    if args.total_timesteps == 0 and args.load_model is not None:  # evaluate a saved agent, train nothing
        if args.eval_episodes < 1:
            sys.exit("error: --total-timesteps 0 and --eval-episodes 0: nothing to do; raise --eval-episodes")
    elif num_iterations < 1:
        sys.exit(f"error: --total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps = "
                 f"{batch_size}), so nothing would be trained; raise it or lower --num-steps "
                 "(0 with --load-model only evaluates)")
    if args.load_model is not None and not os.path.isfile(args.load_model):
        sys.exit(f"error: --load-model {args.load_model}: no such file; pass a .pt written by --save-model")
    if args.save_every < 0 or args.keep_checkpoints < 1:
        sys.exit("error: --save-every must be ≥ 0 and --keep-checkpoints ≥ 1")
    if args.resume is not None and args.load_model is not None:
        sys.exit("error: --resume continues a run, its agent included; --load-model starts a new one from an agent: pass one")
    if args.capture_video:
        if args.eval_episodes < 1:
            sys.exit("error: --capture-video records the evaluation episodes, but --eval-episodes is 0")
        try:
            import moviepy  # noqa: F401  (gymnasium's RecordVideo writes the .mp4 files with it)
        except ImportError:
            sys.exit("error: --capture-video needs moviepy: pip install moviepy")
    return batch_size, minibatch_size, num_iterations


def evaluate(agent, args, device, video_folder=None):
    """Mean return of `eval_episodes` greedy (argmax) episodes on a fresh environment. With
    `video_folder`, every episode is recorded there as an .mp4."""
    env = gym.make(args.env_id, render_mode="rgb_array" if video_folder else None)
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True, disable_logger=True)
    returns = []
    for episode in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 10_000 + episode)
        done, episodic_return = False, 0.0
        while not done:
            with torch.no_grad():
                logits = agent.actor(torch.as_tensor(obs, dtype=torch.float32, device=device))
            obs, reward, terminated, truncated, _ = env.step(int(logits.argmax()) + int(env.action_space.start))
            episodic_return += float(reward)
            done = terminated or truncated
        returns.append(episodic_return)
    env.close()
    return float(np.mean(returns))


def main(args: Args):
    batch_size, minibatch_size, num_iterations = check_args(args)
    checkpoint = find_resume_point(args)  # --resume: checked before any work
    envs = make_envs(args)
    check_env(envs, args, gym.spaces.Discrete)
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    if checkpoint is not None:  # a resumed run goes on in its own run directory
        run_name = os.path.basename(os.path.dirname(checkpoint["path"]))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    obs_dim = envs.single_observation_space.shape[0]
    action_start = envs.single_action_space.start  # Discrete(n, start): the policy's action a is the env's start + a
    agent = Agent(obs_dim, envs.single_action_space.n).to(device)
    # fused: the whole Adam step in one kernel over all parameters (rounds differently from the default loop)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    if args.load_model is not None:
        load_agent(args.load_model, agent, args)

    # a resumed run drops what its logs hold after the checkpoint (purge_step): those steps are taken again
    writer = SummaryWriter(f"runs/{run_name}", purge_step=checkpoint["global_step"] + 1 if checkpoint else None)
    if checkpoint is None:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    # Rollout storage: numpy for the per-step bookkeeping (cheaper than torch for tiny arrays)
    shape = (args.num_steps, args.num_envs)
    obs = np.zeros(shape + (obs_dim,), dtype=np.float32)
    actions = np.zeros(shape, dtype=np.int64)
    logprobs = np.zeros(shape, dtype=np.float32)
    old_logits = np.zeros(shape + (envs.single_action_space.n,), dtype=np.float32)  # for the exact KL
    rewards = np.zeros(shape, dtype=np.float32)
    terminations = np.zeros(shape, dtype=np.float32)
    truncations = np.zeros(shape, dtype=np.float32)
    values = np.zeros(shape, dtype=np.float32)
    final_values = np.zeros(shape, dtype=np.float32)

    beta = args.kl_beta
    global_step, first_iteration = 0, 1
    if checkpoint is not None:  # the agent, Adam, β, every random stream; the episodes start over
        saved = load_resume_point(checkpoint, agent, optimizer, args)
        global_step, first_iteration = saved["global_step"], saved["iteration"] + 1
        beta = saved["beta"]
    preemption = Preemption()
    start_time, start_step = time.time(), global_step
    next_obs, _ = envs.reset(seed=args.seed + first_iteration - 1)  # resumed: other episodes than at the start

    progress = Progress(args.total_timesteps, "env steps", args.progress, done=global_step)
    for iteration in range(first_iteration, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        final_values[:] = 0.0
        weights = agent.numpy_weights()  # the rollout runs the policy in numpy, on the CPU (act)
        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            actions[step], logprobs[step], values[step], old_logits[step] = act(weights, obs[step])

            next_obs, reward, terminated, truncated, infos = envs.step(actions[step] + action_start)
            rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
            if args.bootstrap_truncation and truncated.any():
                # with SAME_STEP autoreset next_obs is already the reset observation; the real last
                # observation of the truncated episode is in final_obs
                final_obs = np.stack(infos["final_obs"][truncated]).astype(np.float32)
                final_values[step, truncated] = mlp(weights[1], final_obs)[:, 0]  # V(final observation)

            for i in np.flatnonzero(infos.get("_episode", ())):  # RecordEpisodeStatistics: the raw rewards
                writer.add_scalar("charts/episodic_return", infos["episode"]["r"][i], global_step)
                writer.add_scalar("charts/episodic_length", infos["episode"]["l"][i], global_step)

        last_value = mlp(weights[1], next_obs.astype(np.float32))[:, 0]
        advantages, returns = compute_gae(rewards, values, last_value, terminations, truncations, final_values,
                                          args.gamma, args.gae_lambda)

        # Flatten the batch and move it to the device once
        b_obs = torch.from_numpy(obs.reshape(batch_size, obs_dim)).to(device)
        b_old_logits = torch.from_numpy(old_logits.reshape(batch_size, -1)).to(device)
        b_actions, b_logprobs, b_advantages, b_returns, b_values = (
            torch.from_numpy(x.reshape(batch_size)).to(device) for x in (actions, logprobs, advantages, returns, values)
        )

        clipfracs = []
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(batch_size, device=device)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start : start + minibatch_size]
                _, newlogprob, entropy, newvalue, newlogits = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()  # k3 estimator, unbiased and >= 0
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                kl = categorical_kl(b_old_logits[mb_inds], newlogits)
                pg_loss = kl_penalty_loss(ratio, mb_advantages, kl, beta)
                with torch.no_grad():  # logged apart, so that losses/policy_loss is the surrogate alone
                    kl_penalty = beta * kl.mean()
                v_loss = value_loss(newvalue, b_values[mb_inds], b_returns[mb_inds], args.clip_coef, args.clip_vloss)
                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef  # eq. 9 with L^KLPEN, negated

                if not torch.isfinite(loss):  # stop before the weights turn to NaN; nothing is saved
                    sys.exit(f"error: the loss is {loss.item()} at iteration {iteration}; nothing was saved "
                             "(lower --learning-rate or --max-grad-norm)")
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        # d = the exact mean KL between the rollout policy and the updated one, over the whole batch
        with torch.no_grad():
            d = categorical_kl(b_old_logits, agent.actor(b_obs)).mean().item()
        writer.add_scalar("losses/kl", d, global_step)
        writer.add_scalar("charts/kl_coef", beta, global_step)  # the β this update was made with
        if args.adaptive_kl:
            beta = update_beta(beta, d, args.kl_target)

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        sps = int((global_step - start_step) / (time.time() - start_time))
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", (pg_loss - kl_penalty).item(), global_step)
        writer.add_scalar("losses/kl_penalty", kl_penalty.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/old_approx_kl", old_approx_kl.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        if iteration % 20 == 0 or iteration == num_iterations:
            recent = f" episodic_return={np.mean(envs.return_queue):.1f}" if envs.return_queue else ""  # the last 100
            print(f"global_step={global_step} SPS={sps}{recent}")
        progress(global_step, f"return {np.mean(envs.return_queue):.1f}" if envs.return_queue else "")

        # ---- checkpoint: every --save-every iterations, and at SIGTERM, which then ends the run (exit code 0) ---
        sigterm = preemption.received
        if sigterm or (args.save_every and iteration % args.save_every == 0):
            save_resume_point(f"runs/{run_name}", iteration, agent, optimizer, args, None,
                              {"global_step": global_step, "beta": beta}, sigterm)
        if sigterm:
            envs.close()
            return writer.close()

    if args.save_model:
        model_path = f"runs/{run_name}/{args.exp_name}.pt"
        save_agent(model_path, agent, args)
        print(f"model saved to {model_path}")
    if args.eval_episodes > 0:
        eval_return = evaluate(agent, args, device, f"videos/{run_name}" if args.capture_video else None)
        writer.add_scalar("eval/episodic_return", eval_return, global_step)
        print(f"eval/episodic_return={eval_return:.2f} over {args.eval_episodes} greedy episodes")

    envs.close()
    writer.close()



# =============================================================================================
# Plumbing: making and checking the environments, saving and loading checkpoints. Each definition below
# is pasted from the scripts that share it, one text in all of them (tests/test_copies.py checks each). A
# reader learning the algorithm can stop here.
# =============================================================================================


def first_line(e):
    """An exception's message as one line, for a one-line error: its first line, or the exception's type when
    the message is empty."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def make_envs(args):
    """Vector envs that reset in the same step an episode ends (gymnasium >= 1.0's default would
    instead emit one extra transition, belonging to no episode, after every episode end), each episode's
    return and length in the step's infos["episode"] when it ends (RecordEpisodeStatistics)."""
    try:
        envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make(args.env_id) for _ in range(args.num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        return gym.wrappers.vector.RecordEpisodeStatistics(envs)
    except gym.error.Error as e:
        sys.exit(f"error: cannot make env {args.env_id!r}: {e}")


def check_env(envs, args, action_space):
    """One-line errors for an environment this script cannot train on or (with --capture-video) film."""
    if not isinstance(envs.single_action_space, action_space):
        sys.exit(f"error: {args.env_id} has {envs.single_action_space} actions; this script needs {action_space.__name__} "
                 "ones (ppo_clip.py and ppo_kl.py take Discrete actions, ppo_continuous.py Box ones)")
    if not (isinstance(envs.single_observation_space, gym.spaces.Box) and len(envs.single_observation_space.shape) == 1):
        sys.exit(f"error: {args.env_id} has {envs.single_observation_space} observations; this script needs a flat Box")
    if args.capture_video:
        try:
            env = gym.make(args.env_id, render_mode="rgb_array")
            env.reset(seed=args.seed)
            env.render()
            env.close()
        except Exception as e:  # a missing renderer: pygame (classic control), OpenGL (MuJoCo)
            sys.exit(f"error: --capture-video: {args.env_id} cannot render here ({first_line(e)}); classic "
                     "control needs `pip install pygame`, MuJoCo without a display MUJOCO_GL=egl")


def save_agent(path, agent, args, obs_rms=None, resume=None):
    """The weights, the flags and, when observations are normalized, their running statistics, all as
    tensors and plain types (so the safe `torch.load(path)` reads it); written to a temporary file
    first, so a crash never leaves half a checkpoint. With `resume` (the optimizer's state, the iteration,
    the global step and the algorithm's own state), also every random stream: what --resume needs."""
    checkpoint = {"agent": agent.state_dict(), "args": vars(args), "script": os.path.basename(__file__)}
    if obs_rms is not None:
        checkpoint["obs_rms"] = statistics(obs_rms)
    if resume is not None:
        checkpoint["resume"] = {**resume, "random": random_streams()}
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_agent(path, agent, args, obs_rms=None):
    """Load a `save_agent` file into `agent` (and `obs_rms`); a wrong file is a one-line error. Returns
    the checkpoint."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        for flag in ("env_id", "norm_obs"):  # same sizes, other meaning: it would load, and be wrong
            saved, given = checkpoint["args"].get(flag), getattr(args, flag, None)
            if saved != given:
                sys.exit(f"error: --load-model {path} was saved with {flag}={saved!r}, this run has {given!r}")
        agent.load_state_dict(checkpoint["agent"])
        if obs_rms is not None:
            set_statistics(obs_rms, checkpoint["obs_rms"])
    except Exception as e:  # not a checkpoint, another env's sizes, no statistics
        sys.exit(f"error: --load-model {path}: {type(e).__name__}: {first_line(e)[:200]}; pass a .pt "
                 "that --save-model of this script wrote for the same env and network")
    return checkpoint


def statistics(rms):
    """Running mean and variance statistics as tensors and a float (what the safe torch.load reads)."""
    return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}


def set_statistics(rms, saved):
    rms.mean, rms.var, rms.count = saved["mean"].numpy(), saved["var"].numpy(), saved["count"]


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



# ---------------------------------------------------------------------------------------------
# Long runs: checkpoints to resume from (runs/<run>/checkpoint-<iteration>.pt), and SIGTERM
# ---------------------------------------------------------------------------------------------
# The flags a resumed run may change: where things go and what is evaluated at the end, not what is trained
RESUME_MAY_CHANGE = ("exp_name", "resume", "save_every", "keep_checkpoints", "save_model", "eval_episodes",
                        "capture_video", "cuda", "threads", "progress")


def find_resume_point(args):
    """The checkpoint --resume names (a checkpoint-<iteration>.pt, or a run directory: its latest), checked before
    any work: one of this script, saved with the same flags. Returns {"path", "iteration", "global_step"}, or None
    without --resume."""
    if args.resume is None:
        return None
    path = args.resume
    if os.path.isdir(path):
        found = [int(name[len("checkpoint-") : -len(".pt")]) for name in os.listdir(path)
                 if re.fullmatch(r"checkpoint-\d+\.pt", name)]
        if not found:
            sys.exit(f"error: --resume {path}: no checkpoint-<iteration>.pt there (they are written with --save-every, "
                     "or at SIGTERM); pass a runs/<run> directory that holds one, or the file")
        path = os.path.join(path, f"checkpoint-{max(found)}.pt")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        saved, resume = checkpoint["args"], checkpoint["resume"]
    except Exception as e:  # noqa: BLE001  no file, not a checkpoint, a --save-model file without the resume state
        sys.exit(f"error: --resume {path}: {type(e).__name__}: {first_line(e)[:200]}; pass a checkpoint-"
                 "<iteration>.pt written with --save-every, or its run directory")
    script = os.path.basename(__file__)
    if checkpoint["script"] != script:
        sys.exit(f"error: --resume {path} is a checkpoint of {checkpoint['script']}; resume it with that script, not {script}")
    for name, value in vars(args).items():
        if name not in RESUME_MAY_CHANGE and saved.get(name) != value:
            sys.exit(f"error: --{name.replace('_', '-')} is {value} here but {saved.get(name)} in {path}; a resumed "
                     f"run takes the flags of the run it continues (only "
                     f"{', '.join('--' + n.replace('_', '-') for n in RESUME_MAY_CHANGE)} may change)")
    return {"path": path, "iteration": resume["iteration"], "global_step": resume["global_step"]}


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


def save_resume_point(run_dir, iteration, agent, optimizer, args, obs_rms, state, sigterm=False):
    """runs/<run>/checkpoint-<iteration>.pt: the agent, Adam's state, the observation statistics, every random
    stream and `state` (global step, the algorithm's own); only the last --keep-checkpoints are kept."""
    save_agent(os.path.join(run_dir, f"checkpoint-{iteration}.pt"), agent, args, obs_rms,
                    {"optimizer": optimizer.state_dict(), "iteration": iteration, **state})
    found = sorted(int(name[len("checkpoint-") : -len(".pt")]) for name in os.listdir(run_dir)
                   if re.fullmatch(r"checkpoint-\d+\.pt", name))
    for old in found[: -args.keep_checkpoints]:
        os.remove(os.path.join(run_dir, f"checkpoint-{old}.pt"))
    if sigterm:
        argv = sys.argv[1:]  # the same command, --resume pointing at this run
        flags = [a for i, a in enumerate(argv) if not a.startswith("--resume") and (i == 0 or argv[i - 1] != "--resume")]
        print(f"SIGTERM: stopped after iteration {iteration}, checkpoint saved; resume with:\n"
              f"    python {shlex.join([sys.argv[0], *flags, '--resume', run_dir])}")


def load_resume_point(checkpoint, agent, optimizer, args, obs_rms=None):
    """Load what find_resume_point found: the agent, Adam's state, the observation statistics and every random
    stream; returns the saved state (iteration, global step, the algorithm's own)."""
    saved = load_agent(checkpoint["path"], agent, args, obs_rms)["resume"]
    optimizer.load_state_dict(saved["optimizer"])
    set_random_streams(saved["random"])
    print(f"resumed from {checkpoint['path']} (iteration {saved['iteration']}, global step {saved['global_step']}); "
          "the episodes in progress start over")
    return saved


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
    main(tyro.cli(Args, description=__doc__))
