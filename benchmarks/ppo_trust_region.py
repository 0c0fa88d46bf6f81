"""docs/ppo_kl.md's trust-region table and figure (PPO paper, Table 1, on discrete tasks): what clipping and the KL
penalty do in a regime where unconstrained updates overshoot. Reads the runs of ppo_trust_region.sh.

    python benchmarks/ppo_trust_region.py benchmarks/trust_region/runs docs/curves/trust_region.svg

Prints, per variant and env, the mean over seeds and its 95% confidence interval (Student's t, n − 1 degrees of
freedom) of: the mean return of the last 100 training episodes (the paper's measure), and the learning curve's
mean height (the last-100-episode return averaged over the run's steps: it sees collapses and slow starts that
the final figure forgets); and the median over all updates of the exact KL each update moved the policy by
(`losses/kl`). Draws, per env, the learning curves, that KL per update against the targets, and β of the
adaptive runs. Variants without runs are left out.
"""
import os
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "curves"  # the same runs give the same file
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_curves  # noqa: E402  (its run loading refuses duplicates, runs killed early, runs without eval)

# (exp name, label) in the order of the paper's Table 1
VARIANTS = [("tr_none", "no clipping or penalty"), ("tr_clip", "clipping, ε = 0.2"),
            ("tr_adaptive_0.003", "adaptive KL, d_targ = 0.003"), ("tr_adaptive_0.01", "adaptive KL, d_targ = 0.01"),
            ("tr_adaptive_0.03", "adaptive KL, d_targ = 0.03"), ("tr_fixed_0.3", "fixed KL, β = 0.3"),
            ("tr_fixed_1", "fixed KL, β = 1"), ("tr_fixed_3", "fixed KL, β = 3")]
ENVS = ["CartPole-v1", "Acrobot-v1"]


T_975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}  # t(0.975, n−1)


def interval(values):
    """'mean [low, high]': the mean and its 95% confidence interval over seeds."""
    values = np.asarray(values, dtype=float)
    half = T_975[len(values)] * values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else np.nan
    return f"{values.mean():.1f} [{values.mean() - half:.1f}, {values.mean() + half:.1f}]"


def smooth(values, n=20):
    return np.array([np.mean(values[max(0, i - n + 1): i + 1]) for i in range(len(values))])


def main(root, out_path):
    plot_curves.RL_RUNS = root
    runs = {(env, exp): plot_curves.runs_of(f"rl:{env}__{exp}__*").get((env, exp), {}) for env in ENVS
            for exp, _ in VARIANTS}
    envs = [env for env in ENVS if any(runs[(env, exp)] for exp, _ in VARIANTS)]
    if not envs:
        sys.exit(f"error: no runs of benchmarks/ppo_trust_region.sh in {root}")
    print("| variant | seeds | " + " | ".join(f"{env}: final return | curve mean | median KL per update" for env in envs)
          + " |")
    print("|-|-|" + "-|-|-|" * len(envs))
    for exp, label in VARIANTS:
        if not any(runs[(env, exp)] for env in envs):
            continue
        cells = [",".join(str(s) for s in sorted(set().union(*(runs[(env, exp)] for env in envs))))]
        for env in envs:
            seeds = runs[(env, exp)]
            if not seeds:
                cells += ["", "", ""]
                continue
            curves = [plot_curves.curve(s, "return") for s in seeds.values()]
            finals = [y[-1] for _, y in curves]
            heights = [np.interp(np.linspace(x[0], x[-1], 200), x, y).mean() for x, y in curves]
            kls = np.concatenate([[v for _, v in s["losses/kl"]] for s in seeds.values()])
            cells += [interval(finals), interval(heights), f"{np.median(kls):.1e}"]
        print(f"| {label} | " + " | ".join(cells) + " |")

    fig, axes = plt.subplots(len(envs), 3, figsize=(16, 3.4 * len(envs)), squeeze=False)
    for row, env in enumerate(envs):
        return_ax, kl_ax, beta_ax = axes[row]
        for i, (exp, label) in enumerate(VARIANTS):
            seeds = runs[(env, exp)]
            if not seeds:
                continue
            curves = [plot_curves.curve(s, "return") for s in seeds.values()]
            grid = np.linspace(max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves), 200)
            ys = np.array([np.interp(grid, x, y) for x, y in curves])
            return_ax.plot(grid, ys.mean(0), color=f"C{i}", label=label, linewidth=1)
            return_ax.fill_between(grid, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.12)
            steps = [t for t, _ in next(iter(seeds.values()))["losses/kl"]]
            kl = np.mean([[v for _, v in s["losses/kl"]] for s in seeds.values()], axis=0)
            kl_ax.plot(steps, smooth(kl), color=f"C{i}", label=label, linewidth=1)
            if exp.startswith("tr_adaptive"):
                target = float(exp.split("_")[-1])
                kl_ax.axhline(target, color=f"C{i}", linestyle="--", linewidth=0.8)
                beta = np.exp(np.mean([np.log(np.maximum([v for _, v in s["charts/kl_coef"]], 1e-30))
                                       for s in seeds.values()], axis=0))
                beta_ax.plot(steps, beta, color=f"C{i}", label=label, linewidth=1)
        return_ax.set_title(f"{env}: last-100-episode return (mean over seeds, min-max band)", fontsize=9)
        return_ax.set_xlabel("environment steps")
        kl_ax.set_yscale("log")
        kl_ax.set_title(f"{env}: KL of each update (mean over seeds, 20-update mean); dashed: d_targ", fontsize=9)
        kl_ax.set_xlabel("environment steps")
        beta_ax.set_yscale("log")
        beta_ax.set_title(f"{env}: β of the adaptive runs (geometric mean over seeds)", fontsize=9)
        beta_ax.set_xlabel("environment steps")
        for ax in (return_ax, kl_ax, beta_ax):
            ax.legend(fontsize=6)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    fig.tight_layout()
    fig.savefig(out_path, metadata={"Date": None})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
