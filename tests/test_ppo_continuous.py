"""ppo_continuous.py: the math against values computed by hand, then the values that flow through
`main`, then the script end to end as a user runs it."""
import math
import os

import numpy as np
import pytest
import rl_envs  # noqa: F401  (registers Target-v0)
import torch
from conftest import assert_one_line_error, one_line_exit, only_run_dir, read_scalars, run_script, same_seed_scalars
from rl_envs import (
    ClockEnv,
    advantages_reaching_the_loss,
    env_ids_reset,
    first_gae_inputs,
    gradients_by_network,
    optimizer_steps,
    recorded_writers,
    seeds_taken,
)

import ppo_continuous as pc


# ------------------------------------------------------------------------------------------ the math
def test_gaussian_log_prob():
    # 2-d action a = (1, 0), μ = (0, 0), log σ = (0, log 2), i.e. σ = (1, 2):
    #   dim 1: −1²/(2·1) − 0 − ½ log 2π = −0.5 − 0.918939 = −1.418939
    #   dim 2: −0²/(2·4) − log 2 − ½ log 2π = −0.693147 − 0.918939 = −1.612086
    #   sum = −3.031025
    log_std = torch.tensor([[0.0, math.log(2)]])
    logp = pc.gaussian_log_prob(torch.zeros(1, 2), log_std, torch.tensor([[1.0, 0.0]]))
    assert logp.item() == pytest.approx(-3.031025, abs=1e-5)


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


def test_gae_with_termination_and_truncation():
    # γ = 0.5, λ = 0.8, r = 1, V = 1, 2, 3, 4, last V = 5; termination at t = 1, truncation at t = 2 with
    # final value 10:
    #   t=3: δ = 1 + .5·5 − 4 = −0.5   t=2: δ = 1 + .5·10 − 3 = 3   t=1: δ = 1 + 0 − 2 = −1
    #   t=0: δ = 1 + .5·2 − 1 = 1, Â_0 = 1 + .5·.8·(−1) = 0.6
    col = lambda *x: np.array(x, dtype=np.float32)[:, None]  # noqa: E731
    advantages, _ = pc.compute_gae(col(1, 1, 1, 1), col(1, 2, 3, 4), np.array([5.0], dtype=np.float32),
                                   col(0, 1, 0, 0), col(0, 0, 1, 0), col(0, 0, 10, 0), gamma=0.5, gae_lambda=0.8)
    np.testing.assert_allclose(advantages[:, 0], [0.6, -1, 3, -0.5], rtol=1e-6)


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


def test_clipped_policy_loss_each_region():
    # ε = 0.2; per element max(−Â·r, −Â·clip(r, 0.8, 1.2)):
    #   Â=+1: r=1.1 → −1.1, r=1.5 → max(−1.5, −1.2) = −1.2, r=0.5 → max(−0.5, −0.8) = −0.5
    #   Â=−1: r=1.1 → 1.1,  r=1.5 → max(1.5, 1.2) = 1.5,    r=0.5 → max(0.5, 0.8) = 0.8
    #   mean = (−1.1 − 1.2 − 0.5 + 1.1 + 1.5 + 0.8) / 6 = 0.1
    ratios = torch.tensor([1.1, 1.5, 0.5, 1.1, 1.5, 0.5], requires_grad=True)
    advs = torch.tensor([1.0, 1, 1, -1, -1, -1])
    loss = pc.clipped_policy_loss(ratios, advs, 0.2)
    assert loss.item() == pytest.approx(0.1)
    loss.backward()  # no gradient where the clipped term wins (r = 1.5 with Â > 0, r = 0.5 with Â < 0)
    torch.testing.assert_close(ratios.grad, torch.tensor([-1.0, 0, -1, 1, 1, 0]) / 6)


def test_value_loss_clipped_and_unclipped():
    # V = [2.0, 0.5], V_old = [1, 1], R = [3, 0], ε = 0.2
    #   element 0: (2 − 3)² = 1;      clipped 1 + 0.2 = 1.2 → (1.2 − 3)² = 3.24; max 3.24
    #   element 1: (0.5 − 0)² = 0.25; clipped 1 − 0.2 = 0.8 → 0.8² = 0.64;      max 0.64
    #   clipped: ½·(3.24 + 0.64)/2 = 0.97;  unclipped: ½·(1 + 0.25)/2 = 0.3125
    v, v_old, ret = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, 0.0])
    assert pc.value_loss(v, v_old, ret, 0.2, clip=True).item() == pytest.approx(0.97)
    assert pc.value_loss(v, v_old, ret, 0.2, clip=False).item() == pytest.approx(0.3125)


# ------------------------------------------------------------------------------------------ the agent
def test_the_rollout_samples_from_the_policy_the_update_trains():
    # act() (the rollout's step, in numpy) and get_action_and_value() (the update's, in torch) give the same
    # log π(a|s) and V(s) for the sampled action, to float32 rounding, so the first epoch's ratio is 1; the
    # samples have the policy's mean and std
    torch.manual_seed(0)
    np.random.seed(0)
    agent = pc.Agent(3, 2, hidden_size=8, log_std_init=-0.5)
    with torch.no_grad():
        agent.actor_logstd.copy_(torch.tensor([[-0.5, 0.7]]))  # a different std per action dimension
    x = torch.randn(5, 3)
    weights = agent.numpy_weights()
    action, logprob, value = pc.act(weights, x.numpy())
    _, newlogprob, _, newvalue = agent.get_action_and_value(x, torch.from_numpy(action))
    assert torch.allclose(torch.from_numpy(logprob), newlogprob.detach(), atol=1e-5)
    assert torch.allclose(torch.from_numpy(value), newvalue.detach(), atol=1e-6)
    draws = torch.from_numpy(pc.act(weights, x[:1].expand(20_000, 3).numpy())[0])
    mean = agent.actor_mean(x[:1]).detach()[0]
    assert torch.allclose(draws.mean(0), mean, atol=0.05)
    assert torch.allclose(draws.std(0), torch.tensor([math.exp(-0.5), math.exp(0.7)]), rtol=0.03)


# ------------------------------------------------------------- the values that flow through main
# on the CPU on any machine: the spies below compare with tensors made here
CLOCK = dict(env_id="ClockBox-v0", cuda=False, num_envs=2, num_steps=20, num_minibatches=2, update_epochs=1, eval_episodes=0)


def test_a_truncation_bootstraps_from_the_real_final_observation(tmp_path, monkeypatch):
    # ClockBox-v0 episodes alternately terminate at t = 2 and are truncated at t = 3: a truncated step
    # carries V((0.3, 0.5)), the real final observation, not V of the reset one (0, 0.5)
    seen = first_gae_inputs(pc, monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=40, norm_obs=False, norm_reward=False))
    truncated, terminated = seen["truncations"] == 1, seen["terminations"] == 1
    assert truncated.sum() >= 4 and terminated.sum() >= 4
    np.testing.assert_allclose(seen["final_values"][truncated], seen["clock_values"][3], rtol=1e-5)
    assert not np.allclose(seen["clock_values"][3], seen["clock_values"][0])
    assert (seen["final_values"][~truncated] == 0).all()


def test_the_scaled_return_restarts_at_every_episode_end(tmp_path, monkeypatch):
    # reward 1 per step, γ = 0.9, one env: episodes of 2 steps (terminated), 3 (truncated), 2, 3, ...
    # The discounted return G_t = γ G_{t−1} + r_t that the reward scale is estimated from must be
    # 1, 1.9 | 1, 1.9, 2.71 | 1, 1.9 | 1, 1.9, 2.71: it restarts after terminations and truncations alike
    fed = []

    class Recorded(pc.RunningMeanStd):
        def update(self, x):
            if x.ndim == 1:  # the return statistics (the observation ones get [num_envs, obs_dim])
                fed.append(float(x[0]))
            super().update(x)

    monkeypatch.setattr(pc, "RunningMeanStd", Recorded)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "num_envs": 1}, total_timesteps=20, gamma=0.9))
    np.testing.assert_allclose(fed[:10], [1, 1.9, 1, 1.9, 2.71, 1, 1.9, 1, 1.9, 2.71], rtol=1e-6)


def test_observation_statistics_see_each_observation_once_and_evaluation_leaves_them(tmp_path, monkeypatch):
    # the running statistics take the reset observations and one per env step, not the final
    # observations of truncated episodes (those are only looked at, for their value); 2 envs × (1 + 40)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=80, save_model=True))
    checkpoint = torch.load(next(tmp_path.glob("runs/*/ppo_continuous.pt")))
    assert checkpoint["obs_rms"]["count"] == pytest.approx(1e-4 + 2 * 41)
    # evaluation normalizes with the statistics frozen: it reads them and never updates them
    agent, obs_rms = pc.Agent(2, 1), pc.RunningMeanStd(2)
    obs_rms.mean, obs_rms.var, obs_rms.count = np.array([0.1, 0.5]), np.array([0.01, 0.04]), 123.0
    args = pc.Args(env_id="ClockBox-v0", eval_episodes=3)
    pc.evaluate(agent, obs_rms, args, torch.device("cpu"))
    assert obs_rms.count == 123.0 and obs_rms.mean.tolist() == [0.1, 0.5] and obs_rms.var.tolist() == [0.01, 0.04]


def test_the_env_gets_clipped_actions_and_the_policy_trains_on_the_sampled_ones(tmp_path, monkeypatch):
    # σ = e^1.5 = 4.5 around a mean near 0: most samples fall outside the bounds [−2, 2]
    trained_on, real = [], pc.gaussian_log_prob

    def spy(mean, log_std, action):
        if torch.is_grad_enabled():
            trained_on.append(action.detach().abs().max().item())
        return real(mean, log_std, action)

    monkeypatch.setattr(pc, "gaussian_log_prob", spy)
    ClockEnv.actions_received = []
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=40, log_std_init=1.5))
    assert max(trained_on) > 2.0 and max(abs(float(a[0])) for a in ClockEnv.actions_received) <= 2.0


def test_the_seed_reaches_numpy_torch_and_every_reset(tmp_path, monkeypatch):
    # --seed 7 seeds numpy's generator (the rollout's actions), torch's (the initial weights, the minibatch
    # order), the first reset of env i with 7 + i, and evaluation episode e with 7 + 10,000 + e
    seen = seeds_taken(monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "eval_episodes": 2}, seed=7, total_timesteps=40))
    assert seen == {"numpy": [7], "torch": [7], "resets": [7, 8, 10_007, 10_008]}, seen


def test_threads_is_the_number_of_threads_torch_computes_with(tmp_path, monkeypatch):
    # --threads 3 sets torch's CPU threads once, before any work (spied, so this test's own threads stay as they are)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, threads=3, total_timesteps=40))
    assert calls == [3], calls


def test_the_env_id_makes_every_env_and_names_the_run(tmp_path, monkeypatch):
    # --env-id makes the training envs and the evaluation's env; the run is runs/<env>__<exp>__<seed>__<time>
    ids = env_ids_reset(monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "eval_episodes": 1}, exp_name="named", seed=7, total_timesteps=40))
    assert len(ids) >= 3 and set(ids) == {"ClockBox-v0"}, ids  # two training envs and one evaluation episode at least
    assert os.path.basename(only_run_dir(tmp_path)).startswith("ClockBox-v0__named__7__")


def test_every_scalar_is_logged_at_the_env_steps_taken(tmp_path, monkeypatch):
    # the x-axis is global_step, the env steps taken: num_envs × num_steps = 40 an iteration, and
    # total_timesteps // 40 = 2 iterations (the 20 steps left over are not taken)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=100))
    scalars = read_scalars(only_run_dir(tmp_path))
    assert [step for step, _ in scalars["losses/policy_loss"]] == [40, 80]
    ends = [step for step, _ in scalars["charts/episodic_length"]]  # a step of two envs: an even count
    assert len(ends) >= 20 and all(step % 2 == 0 and 0 < step <= 80 for step in ends), ends


def test_a_nan_loss_stops_the_run_with_one_line_and_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "value_loss", lambda *a, **k: torch.tensor(float("nan")))
    writers = recorded_writers(pc, monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        pc.main(pc.Args(**CLOCK, total_timesteps=40, save_model=True))
    assert len(writers) == 1
    for writer in writers:  # the run stopped before closing it
        writer.close()
    assert "the loss is nan at iteration 1" in str(stop.value)
    assert not list(tmp_path.glob("runs/*/*.pt"))


def test_the_evaluation_normalizes_observations_with_the_training_statistics():
    # Clock observations are (t/10, 0.5); with statistics mean (0.2, 0.5), var (4, 1), the first episode's two
    # steps must show the actor ((t/10 − 0.2)/2, 0) = (−0.1, 0), (−0.05, 0), not the raw observations
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return torch.zeros(1)

    agent = pc.Agent(2, 1)
    agent.actor_mean = Spy()
    obs_rms = pc.RunningMeanStd(2)
    obs_rms.mean, obs_rms.var = np.array([0.2, 0.5]), np.array([4.0, 1.0])
    pc.evaluate(agent, obs_rms, pc.Args(env_id="ClockBox-v0", eval_episodes=1), torch.device("cpu"))
    torch.testing.assert_close(torch.stack(seen), torch.tensor([[-0.1, 0.0], [-0.05, 0.0]]))


# ------------------------------------------------------------------------------------ it learns
def test_it_learns_a_one_step_target_task_and_its_std(tmp_path, monkeypatch):
    # Target-v0: reward −(a − x)² for a target x seen in the observation. The last 100 of 2,048 one-step episodes:
    # −0.23 to −0.36 over seeds 1-3 here, from −0.54 to −0.75 for the first 100; with the sign of the policy loss
    # flipped, −5.0 to −5.2 (the mean runs away from the target). The learned std falls from 0.61 to 0.57
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(env_id="Target-v0", total_timesteps=2048, num_steps=256, num_minibatches=4, eval_episodes=0))
    scalars = read_scalars(only_run_dir(tmp_path))
    returns = [v for _, v in scalars["charts/episodic_return"]]
    first, last = np.mean(returns[:100]), np.mean(returns[-100:])
    assert last > -0.45 and last - first > 0.1, (first, last)
    assert scalars["charts/action_std"][-1][1] < 0.59  # from exp(−0.5) = 0.607: the log-std is trained


def test_target_kl_stops_the_epochs_early(tmp_path, monkeypatch):
    # 2 iterations of 4 epochs × 4 minibatches; with --target-kl 1e-9 the approximate KL of the first epoch's last
    # minibatch is above it, so each iteration stops after one epoch: 8 policy losses instead of 32
    calls, real = [], pc.clipped_policy_loss
    monkeypatch.setattr(pc, "clipped_policy_loss", lambda *a: calls.append(1) or real(*a))
    monkeypatch.chdir(tmp_path)
    for target_kl, expected in ((1e-9, 2 * 4), (1e3, 2 * 16)):
        calls.clear()
        pc.main(pc.Args(env_id="Pendulum-v1", total_timesteps=512, num_envs=2, num_steps=128, num_minibatches=4,
                        update_epochs=4, eval_episodes=0, target_kl=target_kl))
        assert len(calls) == expected


# ---------------------------------------------------------------------------- end to end, as a user
TINY = ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "4", "--update-epochs", "2",
        "--total-timesteps", "256", "--eval-episodes", "1"]
TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate", "charts/action_std",
        "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/old_approx_kl",
        "losses/clipfrac", "losses/explained_variance", "eval/episodic_return"]


def test_smoke_save_load_and_evaluate_again(tmp_path):
    # Pendulum episodes last 200 steps: 512 steps over 2 envs see two end
    os.makedirs(tmp_path / "train")
    run_script("ppo_continuous.py", "--env-id", "Pendulum-v1", *TINY, "--total-timesteps", "512", "--eval-episodes",
               "2", "--save-model", cwd=tmp_path / "train")
    run_dir = only_run_dir(tmp_path / "train")
    scalars = read_scalars(run_dir)
    for tag in TAGS:
        assert tag in scalars, tag
    # torch's safe default loader reads the checkpoint: weights, statistics as tensors, flags as plain types
    path = os.path.join(run_dir, "ppo_continuous.pt")
    checkpoint = torch.load(path)
    pc.Agent(3, 1).load_state_dict(checkpoint["agent"])
    assert checkpoint["obs_rms"]["count"] > 512 and checkpoint["args"]["env_id"] == "Pendulum-v1"
    # --load-model with --total-timesteps 0 evaluates it again: the same weights and observation
    # statistics give exactly the same deterministic episodes (the statistics are not touched by the reset)
    os.makedirs(tmp_path / "eval")
    run_script("ppo_continuous.py", "--env-id", "Pendulum-v1", "--load-model", path, "--total-timesteps", "0",
               "--eval-episodes", "2", cwd=tmp_path / "eval")
    again = read_scalars(only_run_dir(tmp_path / "eval"))
    assert again["eval/episodic_return"][0][1] == scalars["eval/episodic_return"][0][1]


def test_mujoco_smoke(tmp_path):
    pytest.importorskip("mujoco", reason="the MuJoCo envs need gymnasium[mujoco] (requirements.txt)")
    run_script("ppo_continuous.py", "--env-id", "HalfCheetah-v5", *TINY, cwd=tmp_path)
    assert "eval/episodic_return" in read_scalars(only_run_dir(tmp_path))


def test_capture_video_records_the_evaluation_episodes(tmp_path):
    pytest.importorskip("moviepy", reason="--capture-video writes its mp4 with moviepy (requirements.txt)")
    pytest.importorskip("pygame", reason="the classic-control envs render with pygame (requirements.txt)")
    run_script("ppo_continuous.py", "--env-id", "Pendulum-v1", *TINY, "--capture-video", cwd=tmp_path)
    videos = list(tmp_path.glob("videos/*/*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000


def test_same_seed_same_results(tmp_path):
    flags = ["--env-id", "Pendulum-v1", *TINY, "--total-timesteps", "512"]
    (a, _), (b, _) = same_seed_scalars("ppo_continuous.py", flags, tmp_path)
    assert a == b and len(a["charts/episodic_return"]) == 2


@pytest.mark.parametrize("flags,words", [
    (["--env-id", "CartPole-v1"], ["Box", "ppo_clip.py"]),
    (["--total-timesteps", "100", "--num-envs", "2", "--num-steps", "64"], ["--total-timesteps 100", "less than one batch"]),
    (["--num-envs", "0"], ["--num-envs 0", "at least 1"]),
    (["--num-minibatches", "0"], ["--num-minibatches 0", "at least 1"]),
    (["--num-envs", "1", "--num-steps", "4", "--num-minibatches", "4"], ["minibatches of 1 sample", "--no-norm-adv"]),
    (["--load-model", "nothing.pt"], ["--load-model nothing.pt", "no such file"]),
    (["--learning-rate", "nan"], ["--learning-rate nan", "finite number > 0"]),
    (["--seed", "-1"], ["--seed -1", "at least 0"]),
    (["--threads", "0"], ["--threads 0", "at least 1"]),
    (["--exp-name", "a/b", "--save-model"], ["--exp-name 'a/b'", "without '/'"]),
    (["--gamma", "1.5"], ["--gamma 1.5", "in [0, 1]"]),
    (["--log-std-init", "nan"], ["--log-std-init nan", "finite"]),
    (["--clip-obs", "0"], ["--clip-obs 0.0", "> 0"]),
    (["--hidden-size", "0"], ["--hidden-size 0", "at least 1"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, flags, words):
    message = one_line_exit("ppo_continuous.py", *flags, cwd=tmp_path)
    assert all(word in message for word in words), message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "videos").exists()


def test_bad_input_from_the_command_line_is_one_line_on_stderr(tmp_path):
    proc = run_script("ppo_continuous.py", "--env-id", "CartPole-v1", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "Box", "ppo_clip.py")
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_saved_without_observation_normalization_is_one_line(tmp_path):
    path = tmp_path / "raw.pt"
    pc.save_agent(str(path), pc.Agent(3, 1), pc.Args(env_id="Pendulum-v1", norm_obs=False), pc.RunningMeanStd(3))
    proc = run_script("ppo_continuous.py", "--env-id", "Pendulum-v1", "--load-model", str(path), "--total-timesteps",
                      "0", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "norm_obs=False")
    assert not (tmp_path / "runs").exists()


def test_the_advantages_that_reach_the_loss_are_gae_of_the_rollout(tmp_path, monkeypatch):
    """main hands GAE its flags: with γ = 0.9 ≠ λ = 0.5 and no normalization of the advantages, those the policy
    loss receives over one epoch are GAE of the recorded rollout (its scaled rewards, terminations and
    truncations), summed out by hand."""
    result = advantages_reaching_the_loss(pc, "clipped_policy_loss", monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(env_id="ClockBox-v0", total_timesteps=40, num_envs=2, num_steps=20, num_minibatches=2,
                    update_epochs=1, norm_adv=False, gamma=0.9, gae_lambda=0.5, eval_episodes=0))
    by_hand, received = result(0.9, 0.5)
    assert len(received) == 40
    np.testing.assert_allclose(np.sort(received), np.sort(by_hand.flatten()), rtol=1e-5, atol=1e-6)


def test_the_rewards_gae_receives_are_scaled_by_the_running_return_std(tmp_path, monkeypatch):
    """--norm-reward (the default): each reward reaches GAE divided by √(var + 1e-8) of the discounted returns seen
    so far, 1, 1.9 | 1, 1.9, 2.71 | ... (reward 1 per step, γ = 0.9, one env), clipped to --clip-reward 3; their
    variance computed here, the count starting at 1e-4 around mean 0 and variance 1 as the running statistics do
    (the merge of one value at a time, written out). A loop that hands GAE the raw rewards (all 1), or clips them to
    anything but --clip-reward, fails."""
    seen = first_gae_inputs(pc, monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "num_envs": 1}, total_timesteps=20, gamma=0.9, norm_obs=False, clip_reward=3.0))
    returns = [1, 1.9, 1, 1.9, 2.71] * 4
    expected, mean, var, count = [], 0.0, 1.0, 1e-4
    for g in returns:  # one value per step: the batch's variance is 0
        delta, total = g - mean, count + 1
        mean, var, count = mean + delta / total, (var * count + delta**2 * count / total) / total, total
        expected.append(min(1.0 / math.sqrt(var + 1e-8), 3.0))  # clipped to --clip-reward 3
    np.testing.assert_allclose(seen["rewards"][:, 0], expected, rtol=1e-5)
    assert not np.allclose(seen["rewards"], 1.0)
    assert 3.0 in expected and min(expected) < 3.0  # the clip binds on some rewards and not on others


def test_without_norm_reward_gae_receives_the_raw_rewards(tmp_path, monkeypatch):
    """--no-norm-reward: GAE receives the env's rewards as they are (1 per step here), neither scaled nor clipped
    (--clip-reward 0.5 would clip them). A loop that scales them whatever the flag says fails."""
    seen = first_gae_inputs(pc, monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "num_envs": 1}, total_timesteps=20, gamma=0.9, norm_obs=False, norm_reward=False,
                    clip_reward=0.5))
    np.testing.assert_array_equal(seen["rewards"], np.ones_like(seen["rewards"]))


def test_a_truncation_bootstraps_from_the_normalized_final_observation(tmp_path, monkeypatch):
    """With --norm-obs the agent sees normalized observations, so a truncated step's bootstrap value is
    V(normalize(final observation)) with the statistics of that step, not V of the raw one: the final observation
    (0.3, 0.5) of each truncation in the first rollout is normalized once (and never folded into the statistics),
    and the value GAE receives for it is the agent's value of what normalize returned, computed here."""
    seen, agents = first_gae_inputs(pc, monkeypatch), []
    real_normalize, normalized = pc.normalize, []

    def normalize_spy(x, mean, var, clip, eps=1e-8):
        out = real_normalize(x, mean, var, clip, eps)
        if np.allclose(x, [0.3, 0.5]):  # only a truncation's real final observation reaches t = 3
            normalized.append(np.asarray(out, dtype=np.float32).copy())
        return out

    real_gae = pc.compute_gae

    def gae_spy(*args):
        if not agents:  # the values of the final observations as normalized, by the agent of that rollout
            agents.append((agent_value(np.concatenate(normalized)), agent_value(np.array([[0.3, 0.5]], np.float32))))
        return real_gae(*args)

    recorded = []
    real_agent = pc.Agent

    class Recorded(real_agent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorded.append(self)

    def agent_value(obs):
        with torch.no_grad():
            return recorded[0].get_value(torch.as_tensor(obs)).squeeze(-1).numpy()

    monkeypatch.setattr(pc, "Agent", Recorded)
    monkeypatch.setattr(pc, "normalize", normalize_spy)
    monkeypatch.setattr(pc, "compute_gae", gae_spy)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=40, norm_reward=False))
    truncated = seen["truncations"] == 1
    assert truncated.sum() >= 4 and len(normalized) >= 1
    values, raw = agents[0]
    assert len(values) == truncated.sum()
    np.testing.assert_allclose(seen["final_values"][truncated], values, rtol=1e-5, atol=1e-6)
    assert not np.allclose(values, float(raw), rtol=1e-3)  # normalizing changes the value: the two can be told apart


@pytest.mark.parametrize("ent_coef,vf_coef,clip_vloss,critic,actor", [
    (0.0, 0.0, True, False, False), (0.5, 0.0, False, False, True), (0.0, 0.5, True, True, False)])
def test_the_entropy_bonus_and_the_value_loss_reach_the_gradient_with_their_coefficients(
        tmp_path, monkeypatch, ent_coef, vf_coef, clip_vloss, critic, actor):
    """With the policy loss zeroed (0 × itself, still in the graph), the actor's gradient is the entropy bonus's,
    −ent_coef · H, and the critic's the value loss's, vf_coef · L^V: a coefficient of 0 leaves its network with
    none, 0.5 gives it one, at every step; --clip-coef reaches the policy loss and the value loss, --clip-vloss
    the value loss. A loss that drops a term or ignores its coefficient or a flag fails."""
    seen = gradients_by_network(pc, "clipped_policy_loss", monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(env_id="ClockBox-v0", total_timesteps=40, num_envs=2, num_steps=20, num_minibatches=2,
                   update_epochs=1, ent_coef=ent_coef, vf_coef=vf_coef, clip_vloss=clip_vloss, clip_coef=0.3,
                   eval_episodes=0))
    assert len(seen["grads"]) == 2 and set(seen["grads"]) == {(critic, actor)}, seen["grads"]
    assert seen["clip_vloss"] == [clip_vloss] * 2 and seen["value_clip"] == [0.3] * 2
    assert seen["policy_loss_args"] == [(0.3,)] * 2


def test_the_advantages_are_normalized_within_each_minibatch(tmp_path, monkeypatch):
    """--norm-adv (the default): each of the 2 minibatches' advantages reaches the loss with mean 0 and std 1
    (unbiased, as torch.std), where the GAE of the rollout, summed out by hand, has neither. A loop that skips the
    normalization fails."""
    result = advantages_reaching_the_loss(pc, "clipped_policy_loss", monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(env_id="ClockBox-v0", total_timesteps=40, num_envs=2, num_steps=20, num_minibatches=2,
                   update_epochs=1, gamma=0.9, gae_lambda=0.5, eval_episodes=0))
    by_hand, received = result(0.9, 0.5)
    assert abs(by_hand.mean()) > 0.1 or abs(by_hand.std(ddof=1) - 1) > 0.1, by_hand  # normalization shows
    for minibatch in np.split(received, 2):
        assert abs(minibatch.mean()) < 1e-5 and abs(minibatch.std(ddof=1) - 1) < 1e-4, minibatch


@pytest.mark.parametrize("anneal_lr, by_hand", [(True, [1.0, 1.0, 0.5, 0.5]), (False, [1.0, 1.0, 1.0, 1.0])])
def test_each_optimizer_step_takes_the_annealed_learning_rate_and_clip(tmp_path, monkeypatch, anneal_lr, by_hand):
    """--anneal-lr: iteration i = 1..N steps at (1 − (i − 1)/N) × --learning-rate, every minibatch of it alike: over
    N = 2 iterations of 2 minibatches, 1, 1, ½, ½ of the peak; without it, the peak throughout. Every step clips the
    gradient norm to --max-grad-norm. A loop that ignores either flag fails."""
    seen = optimizer_steps(pc, monkeypatch)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**CLOCK, total_timesteps=80, learning_rate=1e-3, anneal_lr=anneal_lr, max_grad_norm=0.3))
    assert seen["lr"] == pytest.approx([1e-3 * lr for lr in by_hand], rel=1e-6)
    assert seen["max_norm"] == [0.3] * 4


def test_observations_are_clipped_to_clip_obs_in_training_and_evaluation(tmp_path, monkeypatch):
    """--norm-obs (the default) clips every normalized observation to ±--clip-obs: those of the rollout, of a
    truncation's bootstrap and of the evaluation. With --clip-obs 0.5 on ClockBox-v0 (its first coordinate 0 to 0.3
    while the statistics are young), every normalization clips at 0.5 and some observation reaches it. A loop that
    clips anywhere to another bound fails."""
    real_normalize, seen = pc.normalize, []

    def normalize_spy(x, mean, var, clip, eps=1e-8):
        out = real_normalize(x, mean, var, clip, eps)
        seen.append((clip, float(np.abs(out).max())))
        return out

    monkeypatch.setattr(pc, "normalize", normalize_spy)
    monkeypatch.chdir(tmp_path)
    pc.main(pc.Args(**{**CLOCK, "eval_episodes": 1}, total_timesteps=40, clip_obs=0.5))
    assert {clip for clip, _ in seen} == {0.5} and len(seen) > 20
    assert max(largest for _, largest in seen) == 0.5
