"""The benchmark tools: plot_curves.py and summarize.py must refuse to mix runs; the rollout timers must time what they
say; the generated tasks are what docs/grpo.md says."""
import glob
import os
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import make_arithmetic  # noqa: E402
import rollout_speed  # noqa: E402
import summarize  # noqa: E402  (plot_curves, whose pyplot is slow, only when a table needs it)


@pytest.fixture
def plot_curves():
    """benchmarks/plot_curves.py, imported by the tests that use it: its pyplot costs every worker's collection."""
    import plot_curves

    return plot_curves


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


def test_finished_runs_group_by_experiment_and_seed(tmp_path, monkeypatch, plot_curves):
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
def test_duplicates_runs_killed_early_and_runs_without_their_eval_are_refused(tmp_path, monkeypatch, second, words,
                                                                             plot_curves):
    monkeypatch.setattr(plot_curves, "RL_RUNS", str(tmp_path))
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__1__100", 1024)
    fake_rl_run(tmp_path, **second)
    with pytest.raises(SystemExit) as stop:
        plot_curves.runs_of("rl:CartPole-v1__ppo_clip__*")
    assert words in str(stop.value)


def test_the_summary_refuses_runs_killed_early_too(tmp_path, capsys):
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__1__100", 1024)
    summarize.ppo(str(tmp_path))
    assert "| ppo_clip.py | CartPole-v1 | 1 |" in capsys.readouterr().out
    fake_rl_run(tmp_path, "CartPole-v1__ppo_clip__2__200", 512)
    with pytest.raises(SystemExit) as stop:
        summarize.ppo(str(tmp_path))
    assert "stopped before step 1,024" in str(stop.value)


@pytest.mark.parametrize("betas, words", [([1.0, 0.5, 1.0, 2.0], "β between 0.5 and 2 throughout"),
                                          ([1.0, 1e-3, 1e-7, 1e-8], "β < 1e-6 from update 3 (step 1,536)")])
def test_the_beta_plot_reads_runs_where_the_penalty_binds_and_where_it_vanishes(tmp_path, capsys, betas, words):
    writer = SummaryWriter(os.path.join(tmp_path, "CartPole-v1__ppo_kl__1__100"))
    for i, beta in enumerate(betas):
        writer.add_scalar("charts/kl_coef", beta, 512 * (i + 1))
        writer.add_scalar("losses/kl", 0.01, 512 * (i + 1))
    writer.close()
    summarize.beta_figure(str(tmp_path), str(tmp_path / "beta.svg"))
    assert words in capsys.readouterr().out and (tmp_path / "beta.svg").read_text().startswith("<svg")


def test_the_rollout_timer_counts_the_loop_and_its_parts(tiny_checkpoints, tmp_path):
    """benchmarks/rollout_timer.py on scale/grpo.py and scale/rlhf_ppo.py (the programs whose speed it profiles): the script's own completions/s, and parts that are
    each timed (generation, reward, the rollout's forward passes) and add up to less than the loop."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    models = tiny_checkpoints["cwd"] / "models"
    for script, extra in (("scale/grpo.py", []), ("scale/rlhf_ppo.py", ["--reward-model-path", str(models / "reward_model")])):
        proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "rollout_timer.py"),
                               os.path.join(root, script), "--profile", "--model-name-or-path", str(models / "sft"), *extra,
                               "--num-iterations", "2", "--batch-size", "16", "--mini-batch-size", "8", "--eval-size", "8",
                               "--output-dir", "out"], cwd=tmp_path, capture_output=True, text=True, check=True)
        out = json.loads(proc.stdout.splitlines()[-1])
        parts = out["parts"]
        assert out["completions_per_s"] == pytest.approx(32 / out["seconds"])
        assert parts["generation"] > 0 and parts["reward"] > 0 and parts["rollout log-probs and values"] > 0
        assert 0 < parts["update and the rest"] < out["seconds"]
        if script == "scale/grpo.py":  # the tokens sampled in the loop: the logged mean completion length × 16, summed
            from conftest import read_scalars

            lengths = read_scalars(glob.glob(str(tmp_path / "runs" / "grpo__*"))[0])["objective/completion_length"]
            assert len(lengths) == 2 and out["generated_tokens"] == round(sum(v * 16 for _, v in lengths))
            assert out["generation_tokens_per_s"] == pytest.approx(out["generated_tokens"] / parts["generation"])


@pytest.mark.parametrize("key, unit", [("completions_per_s", "completions/s"), ("samples_per_second", "samples/s"),
                                       ("charts/samples_per_second", "samples/s")])
def test_side_by_side_pairs_alternate_and_report_every_ratio(tmp_path, capsys, key, unit):
    """benchmarks/rollout_speed.py: A B, B A, A B; every pair's ratio B / A, the median and the range, of a rollout
    loop's completions/s (rollout_timer.py, trl_grpo.py) or a supervised loop's samples/s (gpu_step.py: the scripts'
    charts/samples_per_second; trl_supervised.py)."""
    order = tmp_path / "order"
    commands = []
    sides = (("A", [10.0, 20.0, 10.0], [8.0, 16.0, 8.0]), ("B", [15.0, 20.0, 40.0], [12.0, 32.0, 16.0]))
    for name, speed, steady in sides:
        script = tmp_path / f"{name}.py"
        steady_fields = (f", 'steady_samples_per_second': {steady}[runs], 'warmup_steps': 10"
                         if key == "samples_per_second" else "")
        script.write_text("import json, sys\n"
                          f"runs = open({str(order)!r}).read().count({name!r}) if __import__('os').path.exists({str(order)!r}) else 0\n"
                          f"open({str(order)!r}, 'a').write({name!r})\n"
                          f"print(json.dumps({{{key!r}: {speed}[runs], 'seconds': 1.0{steady_fields}}}))\n")
        commands.append(f"{name}={sys.executable} {script}")
    rollout_speed.main("3", *commands)
    assert order.read_text() == "ABBAAB"
    table = capsys.readouterr().out
    assert "| 10.0, 20.0, 10.0 | 15.0, 20.0, 40.0 | 1.50, 1.00, 4.00 | **1.50×** | 1.00–4.00 |" in table
    assert f"| A ({unit}) | B ({unit}) |" in table
    # the steady speeds after the warmup (step_clock.py), where both sides report them: their own pairs and ratios
    assert ("steady samples/s, after the first 10 steps" in table) == (key == "samples_per_second")
    assert ("| 8.0, 16.0, 8.0 | 12.0, 32.0, 16.0 | 1.50, 2.00, 2.00 | **2.00×** | 1.50–2.00 |" in table) == (
        key == "samples_per_second")


def test_an_untimed_first_run_is_left_out(tmp_path, capsys, monkeypatch):
    """UNTIMED_FIRST=1: A runs once before the pairs (A, then A B) and that run's speed is in no table."""
    order = tmp_path / "order"
    commands = []
    for name, speed in (("A", [5.0, 10.0]), ("B", [15.0])):
        script = tmp_path / f"{name}.py"
        script.write_text("import json, os\n"
                          f"runs = open({str(order)!r}).read().count({name!r}) if os.path.exists({str(order)!r}) else 0\n"
                          f"open({str(order)!r}, 'a').write({name!r})\n"
                          f"print(json.dumps({{'samples_per_second': {speed}[runs], 'seconds': 1.0}}))\n")
        commands.append(f"{name}={sys.executable} {script}")
    monkeypatch.setenv("UNTIMED_FIRST", "1")
    rollout_speed.main("1", *commands)
    assert order.read_text() == "AAB"
    assert "| 10.0 | 15.0 | 1.50 | **1.50×** | 1.50–1.50 |" in capsys.readouterr().out


def test_the_step_clock_times_the_optimizer_steps_after_the_warmup(monkeypatch):
    """benchmarks/step_clock.py: a hook on every optimizer's step notes the time after it; the steady speed counts
    the steps after the first `warmup`, from the end of step `warmup` to the end of the last (steps ending at 1, 2,
    4, 7 and 11 s, warmup 2, 8 samples a step: 3 steps × 8 / (11 − 2) s), and a run of no more steps than the
    warmup reports nothing. The hook goes away with the clock's handle."""
    import step_clock
    import torch

    ends = iter([1.0, 2.0, 4.0, 7.0, 11.0])
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(ends))
    monkeypatch.setattr(step_clock.torch.cuda, "is_available", lambda: False)
    clock = step_clock.StepClock(warmup=2)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    try:
        for step in range(5):
            weight.sum().backward()
            optimizer.step()
            if step == 1:
                assert clock.report(8) == {}
    finally:
        clock.handle.remove()
    assert clock.report(8) == {"steady_samples_per_second": pytest.approx(3 * 8 / 9), "steady_steps": 3,
                               "warmup_steps": 2}
    optimizer.step()
    assert len(clock.times) == 5


def test_the_held_out_task_is_another_task_whose_answers_are_right():
    """make_arithmetic.py's held-out problems: every answer's work and its `####` number are right, the gold reward
    (numeric_match) gives the answer itself 1, a quarter take two steps, and they share no question with the
    arithmetic task (another operation, other sentences); its answers run longer (arithmetic.sh samples 40 tokens)."""
    import random

    import grpo

    rng = random.Random(1)
    rows = [make_arithmetic.heldout_problem(rng) for _ in range(400)]
    two_steps = 0
    for row in rows:
        work, number = row["answer"].split("\n#### ")
        steps = [step.split(" = ") for step in work.split(", ")]
        for expression, result in steps:
            a, b = (int(x) for x in expression.split(" - "))
            assert a - b == int(result) and int(result) > 0, row
        assert int(steps[-1][1]) == int(number)
        assert grpo.numeric_match([row["question"]], [" " + row["answer"]], [row["answer"]]) == [1.0]
        two_steps += len(steps) == 2
    assert 0.15 < two_steps / len(rows) < 0.35
    arithmetic = {make_arithmetic.problem(random.Random(i), 50)["question"] for i in range(400)}
    assert not arithmetic & {row["question"] for row in rows}
    assert max(len(" " + row["answer"]) for row in rows) + 1 <= 40


def test_the_variants_table_intervals():
    """One seed: the 95% binomial interval of one evaluation of 512 prompts, 1.96 √(p(1 − p)/512); three: the 95%
    t-interval of the mean over seeds, t(2) = 4.303 × sd / √3 (sd with n − 1)."""
    assert summarize.interval([0.5], 512) == pytest.approx((0.5, 1.96 * (0.25 / 512) ** 0.5))
    assert summarize.interval([0.80, 0.82, 0.84], 512) == pytest.approx((0.82, 4.303 * 0.02 / 3 ** 0.5))


def test_the_step_clock_profiles_the_steps_after_the_warmup():
    """With profile_steps, the profiler records the steps after the warmup and the report gives the wall time per
    step and the operators that took longest, with their calls per step (on the CPU: the 384 × 384 matrix products
    first, one optimizer step a step; the kernel fields are the GPU's, None here)."""
    import step_clock
    import torch

    clock = step_clock.StepClock(warmup=2, profile_steps=3)
    weight = torch.nn.Parameter(torch.ones(384, 384))
    optimizer = torch.optim.SGD([weight], lr=1e-6)
    try:
        for _ in range(6):
            (weight @ weight @ torch.ones(384)).sum().backward()
            optimizer.step()
    finally:
        clock.handle.remove()
    profile = clock.report(8)["profile"]
    assert profile["steps"] == 3 and profile["wall_ms_per_step"] > 0
    ops = {name: calls for name, _, calls in profile["top_ops_ms_per_step"]}
    if not torch.cuda.is_available():
        assert profile["gpu_busy"] is None and profile["kernels_per_step"] is None
        assert profile["top_ops_ms_per_step"][0][0] == "aten::mm", profile["top_ops_ms_per_step"]
        assert ops["Optimizer.step#SGD.step"] == 1.0, profile["top_ops_ms_per_step"]
