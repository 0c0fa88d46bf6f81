"""Summarize benchmark runs: mean ± std over seeds of the mean return of the last 100 training episodes.

    python benchmarks/summarize_ppo.py benchmarks/runs
Groups run directories named <env>__<exp>__<seed>__<time> by (env, exp). Refuses, as plot_curves.py does, two
runs of one seed in a group, a run that stopped before its last step (killed early) and one without its evaluation.
"""
import collections
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_curves  # noqa: E402  (its run loading and checks)


def main(root):
    groups = collections.defaultdict(dict)
    for run_dir in sorted(glob.glob(os.path.join(root, "*__*__*__*"))):
        env_id, exp_name, seed, _ = os.path.basename(run_dir).split("__")
        scalars, args = plot_curves.load(run_dir)
        plot_curves.check(run_dir, scalars, args, rl=True)
        if int(seed) in groups[(env_id, exp_name)]:
            sys.exit(f"error: two runs of {env_id}__{exp_name} with seed {seed} in {root}: keep one")
        returns = [v for _, v in scalars["charts/episodic_return"]]
        evals = [v for _, v in scalars.get("eval/episodic_return", [])]
        groups[(env_id, exp_name)][int(seed)] = (np.mean(returns[-100:]), scalars["charts/SPS"][-1][1],
                                                 evals[-1] if evals else np.nan)
    print("| script | env | seeds | last-100-episode return (mean ± std over seeds) | per seed | eval return | SPS |")
    print("|-|-|-|-|-|-|-|")
    for (env_id, exp_name), runs in sorted(groups.items()):
        seeds = sorted(runs)
        means, sps, evals = (np.array([runs[s][i] for s in seeds]) for i in range(3))
        print(f"| {exp_name}.py | {env_id} | {','.join(map(str, seeds))} | {means.mean():,.2f} ± {means.std():,.2f} "
              f"| {' / '.join(f'{m:,.1f}' for m in means)} | {np.mean(evals):,.2f} | {np.mean(sps):,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/runs")
