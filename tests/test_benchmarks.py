"""benchmarks/plot_curves.py draws the README's curves from benchmark runs; it must refuse to mix runs."""
import os
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plot_curves  # noqa: E402
import plot_ppo_kl_beta  # noqa: E402
import summarize_ppo  # noqa: E402


def fake_rl_run(root, name, last_step, with_eval=True, total=1024):
    """A run directory as ppo_clip.py writes it: hyperparameters, episodes, SPS per iteration, the eval."""
    writer = SummaryWriter(os.path.join(root, name))
    args = {"num_envs": 2, "num_steps": 256, "total_timesteps": total, "eval_episodes": 10}
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in args.items()))
    for step in range(512, last_step + 1, 512):
        writer.add_scalar("charts/episodic_return", step / 10, step)
        writer.add_scalar("charts/SPS", 1000, step)
    if with_eval:
        writer.add_scalar("eval/episodic_return", 100.0, last_step)
    writer.close()


def test_finished_runs_group_by_experiment_and_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(plot_curves, "RL_RUNS", str(tmp_path))
    for seed in (1, 2):
        fake_rl_run(tmp_path, f"CartPole-v1__ppo_clip__{seed}__100", 1024)
    groups = plot_curves.runs_of("rl:CartPole-v1__ppo_clip__*")
    assert list(groups) == [("CartPole-v1", "ppo_clip")] and sorted(groups[("CartPole-v1", "ppo_clip")]) == [1, 2]


@pytest.mark.parametrize("second, words", [
    (dict(name="CartPole-v1__ppo_clip__1__200", last_step=1024), "two runs of CartPole-v1__ppo_clip with seed 1"),
    (dict(name="CartPole-v1__ppo_clip__2__200", last_step=512), "stopped before step 1,024"),
    (dict(name="CartPole-v1__ppo_clip__2__200", last_step=1024, with_eval=False), "no eval/episodic_return"),
])
def test_duplicates_runs_killed_early_and_runs_without_their_eval_are_refused(tmp_path, monkeypatch, second, words):
    monkeypatch.setattr(plot_curves, "RL_RUNS", str(tmp_path))
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__1__100", 1024)
    fake_rl_run(tmp_path, **second)
    with pytest.raises(SystemExit) as stop:
        plot_curves.runs_of("rl:CartPole-v1__ppo_clip__*")
    assert words in str(stop.value)


def test_the_summary_refuses_runs_killed_early_too(tmp_path, capsys):
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__1__100", 1024)
    summarize_ppo.main(str(tmp_path))
    assert "| ppo_clip.py | CartPole-v1 | 1 |" in capsys.readouterr().out
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__2__200", 512)
    with pytest.raises(SystemExit) as stop:
        summarize_ppo.main(str(tmp_path))
    assert "stopped before step 1,024" in str(stop.value)


@pytest.mark.parametrize("betas, words", [([1.0, 0.5, 1.0, 2.0], "β between 0.5 and 2 throughout"),
                                          ([1.0, 1e-3, 1e-7, 1e-8], "β < 1e-6 from update 3 (step 1,536)")])
def test_the_beta_plot_reads_runs_where_the_penalty_binds_and_where_it_vanishes(tmp_path, capsys, betas, words):
    writer = SummaryWriter(os.path.join(tmp_path, "CartPole-v1__ppo_kl__1__100"))
    for i, beta in enumerate(betas):
        writer.add_scalar("charts/kl_coef", beta, 512 * (i + 1))
        writer.add_scalar("losses/kl", 0.01, 512 * (i + 1))
    writer.close()
    plot_ppo_kl_beta.main(str(tmp_path), str(tmp_path / "beta.svg"))
    assert words in capsys.readouterr().out and (tmp_path / "beta.svg").read_text().startswith("<svg")
