"""docs/grpo.md's off-policy table and figure (and docs/rlhf_ppo.md's table), from the runs of benchmarks/off_policy.sh:
for each rollout lag K and correction, the final gold accuracy on the 512 eval prompts over the seeds found (mean,
95% t-interval, each seed), the sampler's distance from π_old over the run (mean rollout/kl_k3 and
rollout/logprob_diff_mean), the share of tokens the correction leaves out or the weight's mean, and the KL to the
SFT model; with a figure path, the accuracy against iterations, one panel per lag.

    python benchmarks/summarize_off_policy.py benchmarks/off_policy/grpo [docs/curves/grpo_off_policy.svg]
"""
import collections
import glob
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CORRECTIONS = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "opsm"]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, 0.975 quantile, by degrees of freedom


def scalars(run_dir):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mean(values):
    return sum(values) / len(values)


def interval(values):
    if len(values) < 2:
        return float("nan")
    sd = math.sqrt(sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1))
    return T975[len(values) - 1] * sd / math.sqrt(len(values))


def main(out_dir, figure=None):
    finished = set()
    for line in open(os.path.join(out_dir, "times.txt")):
        lag, correction, seed, seconds = line.split()
        if seconds != "failed":
            finished.add((int(lag), correction, seed))
    runs = collections.defaultdict(dict)  # (lag, correction) -> seed -> logs
    for run_dir in sorted(glob.glob(os.path.join(out_dir, "runs", "*"))):
        name = os.path.basename(run_dir).split("__")[0]  # K<lag>_<correction>_s<seed>
        lag, rest = name[1:].split("_", 1)
        correction, seed = rest.rsplit("_s", 1)
        if (int(lag), correction, seed) in finished:
            runs[int(lag), correction][seed] = scalars(run_dir)
    print("| K | correction | seeds | gold accuracy (95% interval) | per seed | KL[π_sampler ‖ π_old] per token "
          "| abs(Δ log π) per token | weight mean / tokens left out | eval/kl |")
    print("|-|-|-|-|-|-|-|-|-|")
    for (lag, correction), by_seed in sorted(runs.items(), key=lambda x: (x[0][0], CORRECTIONS.index(x[0][1]))):
        seeds = sorted(by_seed)
        final = [by_seed[s]["eval/gold_accuracy"][-1][1] for s in seeds]
        run_mean = lambda tag: mean([mean([v for _, v in by_seed[s][tag]]) for s in seeds])  # noqa: E731
        weights = "—"
        if "rollout/is_weight_mean" in by_seed[seeds[0]]:
            weights = f"{run_mean('rollout/is_weight_mean'):.3f} / {100 * run_mean('rollout/is_masked_fraction'):.2f}%"
        elif "policy/off_policy_masked_fraction" in by_seed[seeds[0]]:
            weights = f"{100 * run_mean('policy/off_policy_masked_fraction'):.1f}% of completions"
        kl = mean([by_seed[s]["eval/kl"][-1][1] for s in seeds]) if "eval/kl" in by_seed[seeds[0]] else float("nan")
        spread = f" ± {100 * interval(final):.1f}" if len(final) > 1 else ""  # one seed: no interval
        print(f"| {lag} | {correction} | {len(seeds)} | {100 * mean(final):.1f}%{spread} | "
              f"{', '.join(f'{100 * v:.1f}' for v in final)} | {run_mean('rollout/kl_k3'):.2e} | "
              f"{run_mean('rollout/logprob_diff_mean'):.2e} | {weights} | {kl:.2f} |")
    if figure:
        plot(runs, figure)


def plot(runs, figure):
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "curves"  # the same runs give the same file
    import matplotlib.pyplot as plt

    lags = sorted({lag for lag, _ in runs})
    fig, axes = plt.subplots(1, len(lags), figsize=(4 * len(lags), 3.2), sharey=True, squeeze=False)
    for ax, lag in zip(axes[0], lags):
        for correction in CORRECTIONS:
            by_seed = runs.get((lag, correction))
            if not by_seed:
                continue
            curves = [by_seed[s]["eval/gold_accuracy"] for s in sorted(by_seed)]
            steps = [step for step, _ in curves[0]]
            values = [[100 * v for _, v in curve] for curve in curves]
            middle = [mean(column) for column in zip(*values)]
            line, = ax.plot(steps, middle, label=correction)
            ax.fill_between(steps, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)],
                            color=line.get_color(), alpha=0.15)
        ax.set_title(f"--rollout-lag {lag}")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("gold accuracy, %")
    axes[0][-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(figure)
    print(f"\nwrote {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
