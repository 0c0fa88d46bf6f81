"""Small environments whose right answers are known, and spies on the RL scripts, for their wiring tests."""
import gymnasium as gym
import numpy as np


class CountingEnv(gym.Env):
    """Random rewards, random terminations, a time limit of 7 (registered below); it records the
    true return of every finished episode and counts every step it is asked to take."""

    finished_returns: list = []
    steps_taken = 0
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        if getattr(self, "episode_steps", 0) > 0:
            CountingEnv.finished_returns.append(self.episode_return)
        self.episode_return, self.episode_steps = 0.0, 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        CountingEnv.steps_taken += 1
        reward = float(self.np_random.uniform(0, 1)) + float(action)
        self.episode_return += reward
        self.episode_steps += 1
        terminated = bool(self.np_random.uniform() < 0.15)
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), reward, terminated, False, {}


class ClockEnv(gym.Env):
    """The observation is (t / 10, 0.5) at step t of the episode; reward 1 per step. Episodes of even
    number terminate after 2 steps; the others run until the time limit of 3 (registered below) cuts
    them. So a truncation's real final observation is (0.3, 0.5), while the reset one is (0, 0.5)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    actions_received: list = []

    def __init__(self, continuous=False, render_mode=None):
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32) if continuous else gym.spaces.Discrete(2)
        self.episode = -1

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return np.array([0.0, 0.5], dtype=np.float32), {}

    def step(self, action):
        ClockEnv.actions_received.append(action)
        self.t += 1
        terminated = self.episode % 2 == 0 and self.t == 2
        return np.array([self.t / 10, 0.5], dtype=np.float32), 1.0, terminated, False, {}


class TargetEnv(gym.Env):
    """A one-step task for continuous actions: the observation is a target x in [-1, 1], the reward −(a − x)² for the
    action a, and the episode ends. A policy that learns moves its mean toward x: the return rises toward −σ²."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)

    def __init__(self, render_mode=None):
        pass

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.x = self.np_random.uniform(-1, 1, 1).astype(np.float32)
        return self.x, {}

    def step(self, action):
        return self.x.copy(), -float((action[0] - self.x[0]) ** 2), True, False, {}


class OffsetActionsEnv(gym.Env):
    """Discrete(3, start=5) actions: the env's actions are 5, 6 and 7. It records every action it receives."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3, start=5)
    received: list = []

    def __init__(self, render_mode=None):
        pass

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        OffsetActionsEnv.received.append(int(action))
        return np.zeros(2, dtype=np.float32), 1.0, False, False, {}


gym.register("CountingEnv-v0", entry_point=CountingEnv, max_episode_steps=7)
gym.register("Clock-v0", entry_point=ClockEnv, max_episode_steps=3)
gym.register("Target-v0", entry_point=TargetEnv)
gym.register("OffsetActions-v0", entry_point=OffsetActionsEnv, max_episode_steps=5)
gym.register("ClockBox-v0", entry_point=ClockEnv, kwargs={"continuous": True}, max_episode_steps=3)


def record_agents(module, monkeypatch):
    """Replace `module.Agent` by a subclass that remembers its instances; returns the list."""
    agents = []

    class RecordedAgent(module.Agent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            agents.append(self)

    monkeypatch.setattr(module, "Agent", RecordedAgent)
    return agents


def first_gae_inputs(module, monkeypatch):
    """Wrap `module.compute_gae` to keep the inputs of its first call, together with the values the
    agent gives then to the observations (t/10, 0.5), t = 0..3; returns the dict it fills."""
    import torch

    agents, seen = record_agents(module, monkeypatch), {}
    real = module.compute_gae

    def spy(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda):
        if not seen:
            clock = torch.tensor([[t / 10, 0.5] for t in range(4)])
            with torch.no_grad():
                seen.update(rewards=rewards.copy(), terminations=terminations.copy(), truncations=truncations.copy(),
                            final_values=final_values.copy(), clock_values=agents[0].get_value(clock).numpy())
        return real(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda)

    monkeypatch.setattr(module, "compute_gae", spy)
    return seen


def recorded_writers(module, monkeypatch):
    """The SummaryWriters that `module.main` makes, as a list it fills: a test whose run stops part-way (sys.exit)
    closes them while still in its directory. Left open, a writer's thread flushes later, to the relative path
    runs/..., from whatever directory the process is in by then (another test's: FileNotFoundError in the thread)."""
    writers = []

    class Recorded(module.SummaryWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            writers.append(self)

    monkeypatch.setattr(module, "SummaryWriter", Recorded)
    return writers


def gae_by_hand(rewards, values, last_value, terminations, truncations, final_values, gamma, lam):
    """Â_t = Σ_k (γλ)^k δ_{t+k} over the rest of t's episode within the rollout, each term summed out (not the
    backward recursion): δ_s = r_s + γ V_next(s) − V(s), V_next(s) = 0 after a termination, V(final observation)
    after a truncation, V(s+1) otherwise (`last_value` after the rollout's last step)."""
    T, n = rewards.shape
    advantages = np.zeros((T, n))
    for env in range(n):
        for t in range(T):
            total = 0.0
            for k, s in enumerate(range(t, T)):
                if terminations[s, env]:
                    next_value = 0.0
                elif truncations[s, env]:
                    next_value = final_values[s, env]
                else:
                    next_value = last_value[env] if s == T - 1 else values[s + 1, env]
                total += (gamma * lam) ** k * (rewards[s, env] + gamma * next_value - values[s, env])
                if terminations[s, env] or truncations[s, env]:
                    break
            advantages[t, env] = total
    return advantages


def advantages_reaching_the_loss(module, loss_name, monkeypatch):
    """Record the rollout at `module.compute_gae`'s first call and every `advantages` that `module.<loss_name>`
    receives; returns a function giving (GAE of that rollout by hand, with the γ and λ given, and the advantages
    the loss received, concatenated)."""
    rollout, received = {}, []
    real_gae, real_loss = module.compute_gae, getattr(module, loss_name)

    def gae_spy(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda):
        if not rollout:
            rollout.update(rewards=rewards.copy(), values=values.copy(), last_value=np.array(last_value),
                           terminations=terminations.copy(), truncations=truncations.copy(),
                           final_values=final_values.copy())
        return real_gae(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda)

    def loss_spy(ratio, advantages, *rest):
        received.append(advantages.detach().cpu().numpy().copy())
        return real_loss(ratio, advantages, *rest)

    monkeypatch.setattr(module, "compute_gae", gae_spy)
    monkeypatch.setattr(module, loss_name, loss_spy)
    return lambda gamma, lam: (gae_by_hand(**{k: v.astype(np.float64) for k, v in rollout.items()}, gamma=gamma,
                                           lam=lam), np.concatenate(received))


def gradients_by_network(module, loss_name, monkeypatch):
    """Zero `module.<loss_name>`, the policy loss (0 × itself: still in the graph, no gradient), and record at each
    optimizer step whether the critic's parameters and the others (the actor's) have a gradient, as
    clip_grad_norm_ sees them, the arguments each policy-loss call receives after (ratio, advantages), and the
    clip coefficient and flag each value_loss call receives. Returns {"grads": [(critic, actor)],
    "policy_loss_args": [tuple], "value_clip": [coefficient], "clip_vloss": [flag]}."""
    agents, seen = [], {"grads": [], "policy_loss_args": [], "value_clip": [], "clip_vloss": []}
    real_loss, real_value_loss, real_clip = getattr(module, loss_name), module.value_loss, module.nn.utils.clip_grad_norm_

    class Recorded(module.Agent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            agents.append(self)

    def loss_spy(*args):
        seen["policy_loss_args"].append(args[2:])
        return 0 * real_loss(*args)

    def value_loss_spy(newvalues, oldvalues, returns, clip_coef, clip_vloss):
        seen["value_clip"].append(clip_coef)
        seen["clip_vloss"].append(clip_vloss)
        return real_value_loss(newvalues, oldvalues, returns, clip_coef, clip_vloss)

    def clip_spy(parameters, *args, **kwargs):
        parameters = list(parameters)
        critic = {id(p) for p in agents[-1].critic.parameters()}
        has_grad = lambda ps: any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in ps)  # noqa: E731
        seen["grads"].append((has_grad([p for p in parameters if id(p) in critic]),
                              has_grad([p for p in parameters if id(p) not in critic])))
        return real_clip(parameters, *args, **kwargs)

    monkeypatch.setattr(module, "Agent", Recorded)
    monkeypatch.setattr(module, loss_name, loss_spy)
    monkeypatch.setattr(module, "value_loss", value_loss_spy)
    monkeypatch.setattr(module.nn.utils, "clip_grad_norm_", clip_spy)
    return seen


def optimizer_steps(module, monkeypatch):
    """Record, at each optimizer step, the learning rate Adam steps with and the norm clip_grad_norm_ clips the
    gradient to. Returns {"lr": [rate], "max_norm": [norm]}."""
    adam = module.torch.optim.Adam
    seen, real_step, real_clip = {"lr": [], "max_norm": []}, adam.step, module.nn.utils.clip_grad_norm_

    def step_spy(self, *args, **kwargs):
        seen["lr"].append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    def clip_spy(parameters, max_norm, *args, **kwargs):
        seen["max_norm"].append(max_norm)
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(adam, "step", step_spy)
    monkeypatch.setattr(module.nn.utils, "clip_grad_norm_", clip_spy)
    return seen


def seeds_taken(monkeypatch):
    """Record every seed given to numpy's global generator, torch's, and any environment's reset (gym.Env.reset,
    which every env here and in gymnasium calls with its seed; None, an episode that goes on from the env's own
    stream, is left out): the dict of lists it fills."""
    import torch

    seen = {"numpy": [], "torch": [], "resets": []}
    real_numpy, real_torch, real_reset = np.random.seed, torch.manual_seed, gym.Env.reset

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            seen["resets"].append(seed)
        return real_reset(self, seed=seed, options=options)

    monkeypatch.setattr(np.random, "seed", lambda seed=None: seen["numpy"].append(seed) or real_numpy(seed))
    monkeypatch.setattr(torch, "manual_seed", lambda seed: seen["torch"].append(seed) or real_torch(seed))
    monkeypatch.setattr(gym.Env, "reset", reset)
    return seen


def env_ids_reset(monkeypatch):
    """The id of every environment reset (gym.Env.reset, as in seeds_taken), in order: the list it fills."""
    ids, real_reset = [], gym.Env.reset

    def reset(self, *, seed=None, options=None):
        ids.append(self.spec.id if self.spec is not None else type(self).__name__)
        return real_reset(self, seed=seed, options=options)

    monkeypatch.setattr(gym.Env, "reset", reset)
    return ids
