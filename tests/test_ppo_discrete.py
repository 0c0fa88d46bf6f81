"""ppo_clip.py and ppo_kl.py: the math against hand-computed values, then the scripts end to end."""
import math
import os

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, only_run_dir, read_scalars, run_script

import ppo_clip
import ppo_kl

BOTH = [ppo_clip, ppo_kl]


# ------------------------------------------------------------------------------------------ GAE
@pytest.mark.parametrize("script", BOTH)
def test_gae_with_termination_and_truncation(script):
    # One env, T = 4, γ = λ = 0.5, r = 1 everywhere, V(s_0..s_3) = 1, 2, 3, 4, V(s_4) = 5 after the rollout.
    # The episode terminates at t = 1; a new one is truncated by a time limit at t = 2, where the
    # real final observation is worth 10.
    #   t=3: δ = 1 + .5·5 − 4 = −0.5                      Â_3 = −0.5
    #   t=2: truncated, bootstrap: δ = 1 + .5·10 − 3 = 3  Â_2 = 3            (episode ends: no Â_3 term)
    #   t=1: terminated, no bootstrap: δ = 1 + 0 − 2 = −1 Â_1 = −1
    #   t=0: δ = 1 + .5·2 − 1 = 1                         Â_0 = 1 + .25·(−1) = 0.75
    #   returns = Â + V = 1.75, 1, 6, 3.5
    col = lambda *x: np.array(x, dtype=np.float32)[:, None]  # noqa: E731  shape [T, 1]
    advantages, returns = script.compute_gae(
        rewards=col(1, 1, 1, 1), values=col(1, 2, 3, 4), last_value=np.array([5.0], dtype=np.float32),
        terminations=col(0, 1, 0, 0), truncations=col(0, 0, 1, 0), final_values=col(0, 0, 10, 0),
        gamma=0.5, gae_lambda=0.5)
    np.testing.assert_allclose(advantages[:, 0], [0.75, -1, 3, -0.5])
    np.testing.assert_allclose(returns[:, 0], [1.75, 1, 6, 3.5])


@pytest.mark.parametrize("script", BOTH)
def test_gae_without_truncation_bootstrap(script):
    # Same rollout, bootstrapping off (final values 0): the truncation counts as a termination.
    #   t=2: δ = 1 + 0 − 3 = −2   Â_2 = −2;  the other steps are as before: Â = 0.75, −1, −2, −0.5
    col = lambda *x: np.array(x, dtype=np.float32)[:, None]  # noqa: E731
    advantages, returns = script.compute_gae(
        col(1, 1, 1, 1), col(1, 2, 3, 4), np.array([5.0], dtype=np.float32),
        col(0, 1, 0, 0), col(0, 0, 1, 0), col(0, 0, 0, 0), gamma=0.5, gae_lambda=0.5)
    np.testing.assert_allclose(advantages[:, 0], [0.75, -1, -2, -0.5])
    np.testing.assert_allclose(returns[:, 0], [1.75, 1, 1, 3.5])


@pytest.mark.parametrize("script", BOTH)
def test_gae_with_gamma_unequal_to_lambda(script):
    # γ = 0.9, λ = 0.5 (unequal, so swapping them anywhere shows), one env, T = 3, no episode end,
    # r = 1, 2, 3, V = 1, 1, 1, V after the rollout = 2:
    #   t=2: δ = 3 + .9·2 − 1 = 3.8                 Â_2 = 3.8
    #   t=1: δ = 2 + .9·1 − 1 = 1.9                 Â_1 = 1.9 + .9·.5·3.8 = 3.61
    #   t=0: δ = 1 + .9·1 − 1 = 0.9                 Â_0 = 0.9 + .45·3.61 = 2.5245
    col = lambda *x: np.array(x, dtype=np.float64)[:, None]  # noqa: E731
    advantages, returns = script.compute_gae(col(1, 2, 3), col(1, 1, 1), np.array([2.0]), col(0, 0, 0), col(0, 0, 0),
                                             col(0, 0, 0), gamma=0.9, gae_lambda=0.5)
    np.testing.assert_allclose(advantages[:, 0], [2.5245, 3.61, 3.8])
    np.testing.assert_allclose(returns[:, 0], [3.5245, 4.61, 4.8])


@pytest.mark.parametrize("script", BOTH)
def test_gae_terminated_and_truncated_at_once_is_a_termination(script):
    # T = 1: r = 1, V = 2, both flags set, final value 10: δ = 1 + 0 − 2 = −1
    advantages, _ = script.compute_gae(np.ones((1, 1)), np.full((1, 1), 2.0), np.zeros(1), np.ones((1, 1)),
                                       np.ones((1, 1)), np.full((1, 1), 10.0), gamma=0.9, gae_lambda=0.9)
    assert advantages[0, 0] == pytest.approx(-1.0)


# ----------------------------------------------------------------------------------- the losses
def test_clipped_policy_loss_each_region():
    # ε = 0.2; per element max(−Â·r, −Â·clip(r, 0.8, 1.2)):
    #   Â=+1 r=1.1 inside: max(−1.1, −1.1) = −1.1     Â=−1 r=1.1 inside: max(1.1, 1.1) = 1.1
    #   Â=+1 r=1.5 above:  max(−1.5, −1.2) = −1.2     Â=−1 r=1.5 above:  max(1.5, 1.2) = 1.5
    #   Â=+1 r=0.5 below:  max(−0.5, −0.8) = −0.5     Â=−1 r=0.5 below:  max(0.5, 0.8) = 0.8
    expected = {(1, 1.1): -1.1, (1, 1.5): -1.2, (1, 0.5): -0.5, (-1, 1.1): 1.1, (-1, 1.5): 1.5, (-1, 0.5): 0.8}
    for (adv, r), value in expected.items():
        ratio = torch.tensor([r], requires_grad=True)
        loss = ppo_clip.clipped_policy_loss(ratio, torch.tensor([float(adv)]), 0.2)
        assert loss.item() == pytest.approx(value)
        loss.backward()
        # where the clipped term wins the gradient is zero: no incentive to move r further
        clipped = (adv, r) in {(1, 1.5), (-1, 0.5)}
        assert ratio.grad.item() == pytest.approx(0.0 if clipped else -adv)
    # all six at once: mean(−1.1, −1.2, −0.5, 1.1, 1.5, 0.8) = 0.6 / 6 = 0.1
    ratios = torch.tensor([1.1, 1.5, 0.5, 1.1, 1.5, 0.5])
    advs = torch.tensor([1.0, 1, 1, -1, -1, -1])
    assert ppo_clip.clipped_policy_loss(ratios, advs, 0.2).item() == pytest.approx(0.1)


@pytest.mark.parametrize("script", BOTH)
def test_value_loss_clipped_and_unclipped(script):
    # V = [2.0, 0.5], V_old = [1, 1], R = [3, 0], ε = 0.2
    #   element 0: (2 − 3)² = 1;      clipped 1 + 0.2 = 1.2 → (1.2 − 3)² = 3.24; max 3.24
    #   element 1: (0.5 − 0)² = 0.25; clipped 1 − 0.2 = 0.8 → 0.8² = 0.64;      max 0.64
    #   clipped: ½·(3.24 + 0.64)/2 = 0.97;  unclipped: ½·(1 + 0.25)/2 = 0.3125
    v, v_old, ret = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, 0.0])
    assert script.value_loss(v, v_old, ret, 0.2, clip=True).item() == pytest.approx(0.97)
    assert script.value_loss(v, v_old, ret, 0.2, clip=False).item() == pytest.approx(0.3125)


def test_categorical_kl_exact():
    # π_old = (½, ½) from logits (0, 0); π_θ = (¾, ¼) from logits (log 3, 0)
    #   KL = ½ log(½ / ¾) + ½ log(½ / ¼) = ½ log(4/3) = 0.143841
    old = torch.tensor([[0.0, 0.0], [5.0, 5.0]])  # the second row: same distribution, shifted logits
    new = torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])
    kl = ppo_kl.categorical_kl(old, new)
    assert kl[0].item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)


def test_kl_penalty_loss():
    # r = [1.2, 0.9], Â = [1, −2], KL = [0.1, 0.3], β = 2
    #   r·Â − β·KL = 1.2 − 0.2 = 1.0  and  −1.8 − 0.6 = −2.4;  mean −0.7;  negated 0.7
    loss = ppo_kl.kl_penalty_loss(torch.tensor([1.2, 0.9]), torch.tensor([1.0, -2.0]), torch.tensor([0.1, 0.3]), 2.0)
    assert loss.item() == pytest.approx(0.7)


def test_update_beta_three_branches():
    # d_targ = 0.01: the band is [0.01/1.5, 0.01·1.5] = [0.00667, 0.015]
    assert ppo_kl.update_beta(1.0, 0.005, 0.01) == 0.5  # below the band: halve
    assert ppo_kl.update_beta(1.0, 0.02, 0.01) == 2.0  # above: double
    assert ppo_kl.update_beta(1.0, 0.01, 0.01) == 1.0  # inside: keep
    assert ppo_kl.update_beta(1.0, 0.015, 0.01) == 1.0  # the edges are inside


# ------------------------------------------------------------------------- end to end, smoke
COMMON_TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
               "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
               "losses/old_approx_kl", "losses/clipfrac", "losses/explained_variance", "eval/episodic_return"]
TINY = ["--total-timesteps", "1024", "--num-envs", "2", "--num-steps", "256", "--eval-episodes", "1"]


@pytest.mark.parametrize("script", ["ppo_clip.py", "ppo_kl.py"])
def test_smoke_two_iterations(script, tmp_path):
    run_script(script, *TINY, "--save-model", cwd=tmp_path)
    run_dir = only_run_dir(tmp_path)
    scalars = read_scalars(run_dir)
    extra = ["charts/kl_beta", "losses/kl"] if script == "ppo_kl.py" else []
    for tag in COMMON_TAGS + extra:
        assert tag in scalars, tag
    assert [step for step, _ in scalars["charts/SPS"]] == [512, 1024]  # two iterations of 2 × 256 steps
    # the saved weights load back into the script's agent
    module = ppo_clip if script == "ppo_clip.py" else ppo_kl
    agent = module.Agent(4, 2)
    agent.load_state_dict(torch.load(os.path.join(run_dir, script.replace(".py", ".pt"))))


def test_kl_beta_follows_the_rule(tmp_path):
    # each logged β is the previous β halved, doubled or kept according to the previous logged KL
    run_script("ppo_kl.py", "--total-timesteps", "4096", "--num-envs", "2", "--num-steps", "256",
               "--eval-episodes", "0", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    betas, kls = [v for _, v in scalars["charts/kl_beta"]], [v for _, v in scalars["losses/kl"]]
    assert betas[0] == 1.0 and len(betas) == 8
    for i in range(1, len(betas)):
        assert betas[i] == pytest.approx(ppo_kl.update_beta(betas[i - 1], kls[i - 1], 0.01))


# ------------------------------------------- gymnasium >= 1.0 autoreset: the logged episodes are the real ones
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


gym.register("CountingEnv-v0", entry_point=CountingEnv, max_episode_steps=7)


@pytest.mark.parametrize("script", BOTH)
def test_logged_returns_are_the_true_episode_returns(script, tmp_path, monkeypatch):
    CountingEnv.finished_returns, CountingEnv.steps_taken = [], 0
    monkeypatch.chdir(tmp_path)
    script.main(script.Args(env_id="CountingEnv-v0", total_timesteps=1024, num_envs=2, num_steps=256,
                            eval_episodes=0))
    logged = [v for _, v in read_scalars(only_run_dir(tmp_path))["charts/episodic_return"]]
    # every env step the script trained on was a real step (no junk transition after an episode end)
    assert CountingEnv.steps_taken == 1024
    # every finished episode was logged, with its true sum of rewards (float32 in TensorBoard)
    assert len(CountingEnv.finished_returns) > 100
    np.testing.assert_allclose(sorted(logged), sorted(CountingEnv.finished_returns), rtol=1e-6)


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("script", ["ppo_clip.py", "ppo_kl.py"])
@pytest.mark.parametrize("flags, words", [
    (["--env-id", "NoSuchEnv-v0"], ["NoSuchEnv-v0"]),
    (["--env-id", "Pendulum-v1"], ["Discrete", "ppo_continuous.py"]),
    (["--num-minibatches", "3"], ["--num-minibatches"]),
])
def test_bad_input_one_line_error(script, flags, words, tmp_path):
    proc = run_script(script, *flags, cwd=tmp_path, check=False)
    assert_one_line_error(proc, *words)
    assert not os.path.exists(tmp_path / "runs")  # nothing half-written


# ------------------------------------------------------------------------------ reproducibility
def test_same_seed_same_results(tmp_path):
    flags = ["--total-timesteps", "1024", "--num-envs", "2", "--num-steps", "256", "--eval-episodes", "2"]
    runs = []
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        run_script("ppo_clip.py", *flags, cwd=tmp_path / name)
        scalars = read_scalars(only_run_dir(tmp_path / name))
        runs.append({tag: values for tag, values in scalars.items() if tag != "charts/SPS"})
    assert runs[0] == runs[1]
    assert len(runs[0]["charts/episodic_return"]) > 10


@pytest.mark.parametrize("script", ["ppo_clip.py", "ppo_kl.py"])
@pytest.mark.parametrize("flags,words", [
    (["--total-timesteps", "100", "--num-envs", "2", "--num-steps", "64"], ["--total-timesteps 100", "less than one batch"]),
    (["--num-envs", "0"], ["--num-envs 0", "at least 1"]),
    (["--num-minibatches", "0"], ["--num-minibatches 0", "at least 1"]),
    (["--num-envs", "1", "--num-steps", "4", "--num-minibatches", "4"], ["minibatches of 1 sample", "--no-norm-adv"]),
])
def test_bad_sizes_are_one_line_and_write_nothing(tmp_path, script, flags, words):
    proc = run_script(script, *flags, cwd=tmp_path, check=False)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "models").exists()
