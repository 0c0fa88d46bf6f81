"""The tables of docs/ppo_clip.md, ppo_kl.md and ppo_continuous.md, and ppo_kl.md's figure of β: mean ± std over
seeds of the mean return of the last 100 training episodes (benchmarks/ppo_discrete.sh and ppo_continuous.sh run it).

    python benchmarks/summarize_ppo.py benchmarks/runs
    python benchmarks/summarize_ppo.py benchmarks/runs --beta-figure docs/ppo_kl_beta.svg

With --beta-figure it also draws the adaptive β of the ppo_kl.py runs (log scale) and the KL of each update as a
plain SVG (no plotting package), and prints per run the 5th and 95th percentiles of the KL per update, the share of
updates below d_targ/1.5 (after which β halves), how many doubled β, and where β stays below 1e-6.

Groups run directories named <env>__<exp>__<seed>__<time> by (env, exp). Refuses, as plot_curves.py does, two
runs of one seed in a group, a run that stopped before its last step (killed early) and one without its evaluation.
"""
import collections
import glob
import math
import os
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

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


W, H, PAD = 720, 260, 50
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def panel(series, y0, title, lo, hi, hlines=()):
    """One log-scale panel: series = [(label, [(step, value), ...])], dashed lines at hlines = [(value, label)]."""
    max_step = max(s for _, pts in series for s, _ in pts)
    x = lambda s: PAD + (W - 2 * PAD) * s / max_step  # noqa: E731
    y = lambda v: y0 + H - PAD - (H - 2 * PAD) * (math.log10(max(v, 10**lo)) - lo) / (hi - lo)  # noqa: E731
    out = [f'<text x="{PAD}" y="{y0 + 20}" font-size="14">{title}</text>',
           f'<rect x="{PAD}" y="{y0 + PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" fill="none" stroke="#999"/>']
    for e in range(lo, hi + 1):
        out.append(f'<text x="{PAD - 5}" y="{y(10**e) + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    for value, label in hlines:
        out.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="black" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{W - PAD - 4}" y="{y(value) - 3:.1f}" font-size="10" text-anchor="end">{label}</text>')
    for i, (label, pts) in enumerate(series):
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLORS[i % 6]}" stroke-width="1"/>')
        out.append(f'<text x="{W - PAD + 5}" y="{y0 + PAD + 14 * i + 10}" font-size="10" fill="{COLORS[i % 6]}">{label}</text>')
    out.append(f'<text x="{W / 2}" y="{y0 + H - 15}" font-size="10" text-anchor="middle">global step (0 to {max_step:,})</text>')
    return out


def beta_figure(root, out_path):
    betas, kls = [], []
    for run_dir in sorted(glob.glob(os.path.join(root, "CartPole-v1__ppo_kl*"))):
        acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        _, exp_name, seed, _ = os.path.basename(run_dir).split("__")
        label = f"{exp_name.replace('ppo_kl_', '') if exp_name != 'ppo_kl' else 'defaults'} s{seed}"
        betas.append((label, [(e.step, e.value) for e in acc.Scalars("charts/kl_coef")]))
        kls.append((label, [(e.step, e.value) for e in acc.Scalars("losses/kl")]))
        target = 0.01  # the default d_targ, which both of ppo_discrete.sh's ppo_kl.py runs use
        d = sorted(v for _, v in kls[-1][1])
        beta = [v for _, v in betas[-1][1]]  # the β each update was made with
        first_small = next((i + 1 for i in range(len(beta)) if all(b < 1e-6 for b in beta[i:])), None)
        gone = (f"β < 1e-6 from update {first_small} (step {betas[-1][1][first_small - 1][0]:,})" if first_small
                else f"β between {min(beta):.2g} and {max(beta):.2g} throughout")  # the penalty binds to the end
        print(f"{label}: KL per update p5 {d[len(d) // 20]:.1e}, p95 {d[len(d) * 19 // 20]:.1e}; "
              f"{sum(v < target / 1.5 for v in d) / len(d):.1%} of {len(d)} updates below d_targ/1.5; "
              f"{sum(v > target * 1.5 for v in d)} doubled β; {gone}")
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + 80}" height="{2 * H}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>']
    lowest = min(v for _, pts in betas for _, v in pts)
    svg += panel(betas, 0, "ppo_kl.py CartPole-v1: β (log scale)", max(-12, math.floor(math.log10(max(lowest, 1e-30)))),
                 max(1, math.ceil(math.log10(max(v for _, pts in betas for _, v in pts)))))
    svg += panel(kls, H, "KL[π_old ‖ π_new] after each update (log scale)", -6, -1,
                 [(0.01 / 1.5, "d_targ/1.5: below it β halves"), (0.01 * 1.5, "1.5·d_targ: above it β doubles")])
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(svg + ["</svg>"]))
    print(f"wrote {out_path}")



if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/runs")
    if "--beta-figure" in sys.argv:
        beta_figure(sys.argv[1], sys.argv[sys.argv.index("--beta-figure") + 1])
