"""Where the time of a classic PPO script goes: cProfile over its main(), grouped into the parts of the loop.

    python benchmarks/ppo_profile.py ppo_clip.py --total-timesteps 102400
    python benchmarks/ppo_profile.py ppo_continuous.py --total-timesteps 20480
    python benchmarks/ppo_profile.py PATH/TO/cleanrl_ppo.py --total-timesteps 102400     # CleanRL's, the same parts

Prints each part's seconds and share of main's time (cumulative, so a part includes what it calls; cProfile's own
overhead inflates the Python-heavy parts, so compare shares between versions, not with wall time).
Works on any version of the scripts, e.g. an older checkout's, for a before/after, and on the CleanRL port of
benchmarks/rl_speed.sh (run as a program, its whole run profiled: its main is the module itself).
"""
import cProfile
import importlib.util
import os
import pstats
import runpy
import sys
import tempfile

import tyro

PARTS = [  # (label, [(file name ending, function name), ...])
    ("the rollout's policy and value: forward, sampling, log-probs (act)",
     [("ppo_clip.py", "act"), ("ppo_kl.py", "act"), ("ppo_continuous.py", "act")]),
    ("the update's forward (get_action_and_value; CleanRL's rollout calls it too)",
     [("ppo_clip.py", "get_action_and_value"), ("ppo_kl.py", "get_action_and_value"),
      ("ppo_continuous.py", "get_action_and_value"), ("cleanrl_ppo.py", "get_action_and_value"),
      ("cleanrl_ppo_continuous_action.py", "get_action_and_value")]),
    ("the vector env's step (the simulator inside)", [("sync_vector_env.py", "step")]),
    ("backward", [("_tensor.py", "backward")]),
    ("Adam", [("adam.py", "step")]),
    ("gradient clipping", [("clip_grad.py", "clip_grad_norm_")]),
    ("GAE", [("ppo_clip.py", "compute_gae"), ("ppo_kl.py", "compute_gae"), ("ppo_continuous.py", "compute_gae")]),
    ("observation and reward statistics (CleanRL: inside the env's step, its wrappers)",
     [("ppo_continuous.py", "normalize"), ("ppo_continuous.py", "update"), ("ppo_continuous.py", "scale_reward")]),
    ("TensorBoard logging", [("writer.py", "add_scalar")]),
    ("setup: making the envs, creating Adam",
     [("sync_vector_env.py", "__init__"), ("adam.py", "__init__")]),  # both sides make their envs with SyncVectorEnv
]


def profile_program(script, flags):
    """A script without main() (the CleanRL port): run as `python script flags` under cProfile."""
    sys.argv = [script, *flags]
    os.chdir(tempfile.mkdtemp())
    profiler = cProfile.Profile()
    profiler.runcall(runpy.run_path, script, run_name="__main__")
    stats = pstats.Stats(profiler).stats
    return stats, next(v[3] for (f, _, name), v in stats.items() if name == "<module>" and f == script)


def warm_imports():
    """Import what both sides import, and what Adam's first step imports lazily (torch._dynamo), before profiling:
    imports are not training, and CleanRL's run is profiled from its first line."""
    import gymnasium  # noqa: F401
    import torch
    import torch.utils.tensorboard  # noqa: F401

    weight = torch.zeros(1, requires_grad=True)
    weight.sum().backward()
    torch.optim.Adam([weight], fused=True).step()


def main(script, flags):
    warm_imports()
    if os.path.basename(script).startswith("cleanrl_"):
        stats, total = profile_program(os.path.abspath(script), flags)
        return report(script, flags, stats, total)
    spec = importlib.util.spec_from_file_location("script", os.path.abspath(script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = tyro.cli(module.Args, args=flags + ["--eval-episodes", "0"])
    os.chdir(tempfile.mkdtemp())  # the run's TensorBoard files go to a scratch directory
    profiler = cProfile.Profile()
    profiler.runcall(module.main, args)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    total = next(v[3] for (f, _, name), v in stats.items() if name == "main" and f.endswith(os.path.basename(script)))
    report(script, flags, stats, total)


def report(script, flags, stats, total):
    print(f"{script} {' '.join(flags)}: main {total:.1f} s under cProfile")
    accounted = 0.0
    for label, functions in PARTS:
        seconds = sum(v[3] for (f, _, name), v in stats.items()
                      if any(f.endswith(end) and name == fn for end, fn in functions))
        if seconds:
            accounted += seconds
            print(f"  {seconds:6.1f} s {seconds / total:6.1%}  {label}")
    print(f"  {total - accounted:6.1f} s {1 - accounted / total:6.1%}  the rest: the loop's own bookkeeping, the losses")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
