"""Summarize benchmark runs: mean ± std over seeds of the mean return of the last 100 training episodes.

    python benchmarks/summarize_ppo.py benchmarks/runs
Groups run directories named <env>__<exp>__<seed>__<time> by (env, exp).
"""
import collections
import glob
import os
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(run_dir, tag):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def main(root):
    groups = collections.defaultdict(list)
    for run_dir in sorted(glob.glob(os.path.join(root, "*__*__*__*"))):
        env_id, exp_name, seed, _ = os.path.basename(run_dir).split("__")
        returns, sps, evals = (scalars(run_dir, t) for t in ("charts/episodic_return", "charts/SPS", "eval/episodic_return"))
        if returns:
            groups[(env_id, exp_name)].append((int(seed), np.mean(returns[-100:]), sps[-1] if sps else np.nan,
                                               evals[-1] if evals else np.nan))
    print("| script | env | seeds | last-100-episode return (mean ± std over seeds) | greedy eval return | SPS |")
    print("|-|-|-|-|-|-|")
    for (env_id, exp_name), runs in sorted(groups.items()):
        seeds, means, sps, evals = zip(*sorted(runs))
        print(f"| {exp_name}.py | {env_id} | {','.join(map(str, seeds))} | {np.mean(means):.2f} ± {np.std(means):.2f} "
              f"| {np.mean(evals):.2f} | {np.mean(sps):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/runs")
