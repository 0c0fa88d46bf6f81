"""ppo_continuous.py: the math against hand-computed values, then the script end to end."""
import math
import os

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, only_run_dir, read_scalars, run_script

import ppo_continuous as pc


def test_gaussian_log_prob():
    # 2-d action a = (1, 0), μ = (0, 0), log σ = (0, log 2), i.e. σ = (1, 2):
    #   dim 1: −1²/(2·1) − 0 − ½ log 2π = −0.5 − 0.918939 = −1.418939
    #   dim 2: −0²/(2·4) − log 2 − ½ log 2π = −0.693147 − 0.918939 = −1.612086
    #   sum = −3.031025
    log_std = torch.tensor([[0.0, math.log(2)]])
    logp = pc.gaussian_log_prob(torch.zeros(1, 2), log_std, torch.tensor([[1.0, 0.0]]))
    assert logp.item() == pytest.approx(-3.031025, abs=1e-5)
    # and it agrees with torch's Normal
    ref = torch.distributions.Normal(torch.zeros(1, 2), log_std.exp()).log_prob(torch.tensor([[1.0, 0.0]])).sum(-1)
    assert logp.item() == pytest.approx(ref.item(), abs=1e-6)


def test_gaussian_entropy():
    # H = Σ ½ log(2πe) + log σ;  ½ log(2πe) = 1.418939
    #   σ = (1, 2): 1.418939 + (1.418939 + 0.693147) = 3.531025
    assert pc.gaussian_entropy(torch.tensor([0.0, math.log(2)])).item() == pytest.approx(3.531025, abs=1e-5)


def test_update_mean_var_merges_exactly():
    # old: 2 samples {0, 2}: μ = 1, σ² = 1.  batch: 2 samples {4, 6}: μ_B = 5, σ_B² = 1.
    #   δ = 4, n' = 4, μ' = 1 + 4·2/4 = 3
    #   σ'² = (1·2 + 1·2 + 16·2·2/4) / 4 = (2 + 2 + 16) / 4 = 5     ({0, 2, 4, 6}: mean 3, var (9+1+1+9)/4 = 5)
    mean, var, count = pc.update_mean_var(1.0, 1.0, 2, 5.0, 1.0, 2)
    assert (mean, var, count) == (pytest.approx(3.0), pytest.approx(5.0), 4)


def test_running_mean_std_matches_numpy():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(100, 4))
    rms = pc.RunningMeanStd(4)
    for chunk in np.split(data, 10):
        rms.update(chunk)
    # the 1e-4 pseudo-count of the initial (0, 1) prior shifts the estimate by ~1e-6
    np.testing.assert_allclose(rms.mean, data.mean(0), atol=1e-4)
    np.testing.assert_allclose(rms.var, data.var(0), atol=1e-3)


def test_normalize_and_clip():
    # (x − μ)/σ with μ = 1, σ² = 4: x = 3 → 1;  x = 41 → 20, clipped to 10;  x = −1 → −1
    out = pc.normalize(np.array([3.0, 41.0, -1.0]), 1.0, 4.0, clip=10.0, eps=0.0)
    np.testing.assert_allclose(out, [1.0, 10.0, -1.0])


def test_scale_reward():
    # Var[G] = 4 → divide by 2: r = 3 → 1.5;  r = −50 → −25, clipped to −10;  the mean is not removed
    np.testing.assert_allclose(pc.scale_reward(np.array([3.0, -50.0]), 4.0, clip=10.0, eps=0.0), [1.5, -10.0])


def test_gae_truncation_bootstraps_termination_does_not():
    # γ = λ = 0.5, r = 1, V = 1, 2, 3, 4, last V = 5; termination at t = 1, truncation at t = 2 with
    # final value 10 (the same rollout as in test_ppo_discrete.py): Â = 0.75, −1, 3, −0.5
    col = lambda *x: np.array(x, dtype=np.float32)[:, None]  # noqa: E731
    advantages, _ = pc.compute_gae(col(1, 1, 1, 1), col(1, 2, 3, 4), np.array([5.0], dtype=np.float32),
                                   col(0, 1, 0, 0), col(0, 0, 1, 0), col(0, 0, 10, 0), gamma=0.5, gae_lambda=0.5)
    np.testing.assert_allclose(advantages[:, 0], [0.75, -1, 3, -0.5])


TINY = ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "4", "--update-epochs", "2",
        "--total-timesteps", "256", "--eval-episodes", "1"]
TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate", "losses/policy_loss",
        "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/clipfrac", "losses/explained_variance",
        "eval/episodic_return"]


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "HalfCheetah-v5"])
def test_smoke(env_id, tmp_path):
    # Pendulum episodes last 200 steps: 256 steps over 2 envs would see none end, so run 512 (4 iterations)
    flags = TINY + ["--total-timesteps", "512"] if env_id == "Pendulum-v1" else TINY
    run_script("ppo_continuous.py", "--env-id", env_id, *flags, "--save-model", cwd=tmp_path)
    run_dir = only_run_dir(tmp_path)
    scalars = read_scalars(run_dir)
    eval_only = {"charts/episodic_return", "charts/episodic_length"} if env_id == "HalfCheetah-v5" else set()
    for tag in TAGS:
        assert tag in scalars or tag in eval_only, tag
    # the checkpoint holds what is needed to act again: weights and observation statistics
    checkpoint = torch.load(os.path.join(run_dir, "ppo_continuous.pt"), weights_only=False)
    obs_dim = checkpoint["obs_rms"]["mean"].shape[0]
    agent = pc.Agent(obs_dim, 1 if env_id == "Pendulum-v1" else 6)
    agent.load_state_dict(checkpoint["agent"])
    assert checkpoint["obs_rms"]["count"] > 256  # it saw the rollouts' observations


def test_discrete_env_is_refused(tmp_path):
    proc = run_script("ppo_continuous.py", "--env-id", "CartPole-v1", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "Box", "ppo_clip.py")
    assert not os.path.exists(tmp_path / "runs")


def test_gae_with_gamma_unequal_to_lambda():
    # γ = 0.9, λ = 0.5, one env, T = 3, no episode end, r = 1, 2, 3, V = 1, 1, 1, V after the rollout = 2:
    #   t=2: δ = 3 + .9·2 − 1 = 3.8   Â_2 = 3.8
    #   t=1: δ = 2 + .9·1 − 1 = 1.9   Â_1 = 1.9 + .9·.5·3.8 = 3.61
    #   t=0: δ = 1 + .9·1 − 1 = 0.9   Â_0 = 0.9 + .45·3.61 = 2.5245
    col = lambda *x: np.array(x, dtype=np.float64)[:, None]  # noqa: E731
    advantages, returns = pc.compute_gae(col(1, 2, 3), col(1, 1, 1), np.array([2.0]), col(0, 0, 0),
                                         col(0, 0, 0), col(0, 0, 0), gamma=0.9, gae_lambda=0.5)
    np.testing.assert_allclose(advantages[:, 0], [2.5245, 3.61, 3.8])
    np.testing.assert_allclose(returns[:, 0], [3.5245, 4.61, 4.8])


@pytest.mark.parametrize("flags,words", [
    (["--total-timesteps", "100", "--num-envs", "2", "--num-steps", "64"], ["--total-timesteps 100", "less than one batch"]),
    (["--num-envs", "0"], ["--num-envs 0", "at least 1"]),
    (["--num-minibatches", "0"], ["--num-minibatches 0", "at least 1"]),
    (["--num-envs", "1", "--num-steps", "4", "--num-minibatches", "4"], ["minibatches of 1 sample", "--no-norm-adv"]),
])
def test_bad_sizes_are_one_line_and_write_nothing(tmp_path, flags, words):
    proc = run_script("ppo_continuous.py", *flags, cwd=tmp_path, check=False)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "models").exists()
