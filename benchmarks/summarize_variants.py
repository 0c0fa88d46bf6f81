"""docs/grpo.md's variants tables, from the runs of benchmarks/grpo_variants.sh: for each variant, the final
evaluation's accuracy (the built-in task's gold accuracy, else eval/rewards/numeric_match: the share of the 512 eval
prompts whose sampled completion is right), its gain over the SFT model (the same evaluation before the first update),
the KL to the SFT model, and the wall time, over the seeds found. With 2 or more seeds the interval is the 95%
t-interval of the mean over seeds; with one, the 95% binomial interval over the eval prompts (sampling noise of one
evaluation).

    python benchmarks/summarize_variants.py benchmarks/variants/arithmetic [runs.csv]

With a second argument, each run's numbers are appended to that CSV file too (task, variant, seed, SFT accuracy,
final accuracy, KL, wall time, mean prompts sampled per iteration, mean zero-std fraction sampled and trained).
"""
import glob
import math
import os
import sys
from collections import defaultdict

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ORDER = ["grpo", "dapo_loss", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "clip_higher", "gspo", "cispo",
         "mask_truncated", "soft_overlong", "dynamic_sampling", "dapo", "trl_defaults"]  # grpo_variants.sh's
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, 0.975 quantile, by degrees of freedom


def scalars(run_dir):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def interval(values, n_prompts):
    """(mean, half-width of the 95% interval)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 1.96 * math.sqrt(mean * (1 - mean) / n_prompts)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, T975[len(values) - 1] * sd / math.sqrt(len(values))


def run_mean(logs, tag):
    return sum(v for _, v in logs[tag]) / len(logs[tag]) if tag in logs else float("nan")


def main(task_dir, csv=None):
    times = defaultdict(dict)
    for line in open(os.path.join(task_dir, "times.txt")):
        variant, seed, seconds = line.split()
        times[variant][seed] = seconds
    rows = defaultdict(dict)  # variant -> seed -> (start accuracy, final accuracy, kl, iterations)
    for run_dir in sorted(glob.glob(os.path.join(task_dir, "runs", "*"))):
        name = os.path.basename(run_dir).split("__")[0]
        variant, seed = name.rsplit("_s", 1)
        logs = scalars(run_dir)
        tag = "eval/gold_accuracy" if "eval/gold_accuracy" in logs else "eval/rewards/numeric_match"
        if tag not in logs or times[variant].get(seed, "failed") == "failed":
            continue
        kl = logs["eval/kl"][-1][1] if "eval/kl" in logs else float("nan")
        rows[variant][seed] = (logs[tag][0][1], logs[tag][-1][1], kl, logs[tag][-1][0])
        if csv:
            with open(csv, "a") as f:
                f.write(",".join(str(x) for x in (
                    os.path.basename(os.path.normpath(task_dir)), variant, seed, round(logs[tag][0][1], 4),
                    round(logs[tag][-1][1], 4), round(kl, 3), times[variant][seed],
                    round(run_mean(logs, "objective/prompts_sampled"), 1),
                    round(run_mean(logs, "objective/zero_std_fraction_sampled"), 3),
                    round(run_mean(logs, "objective/zero_std_fraction"), 3))) + "\n")
    print("| variant | seeds | accuracy (95% interval) | per seed | gain over SFT | KL to SFT | wall time |")
    print("|-|-|-|-|-|-|-|")
    for variant, by_seed in sorted(rows.items(), key=lambda item: ORDER.index(item[0])):
        seeds = sorted(by_seed)
        final = [by_seed[s][1] for s in seeds]
        mean, half = interval(final, 512)
        gain = sum(by_seed[s][1] - by_seed[s][0] for s in seeds) / len(seeds)
        kl = sum(by_seed[s][2] for s in seeds) / len(seeds)
        wall = sum(float(times[variant][s]) for s in seeds) / len(seeds)
        kl_text = "—" if math.isnan(kl) else f"{kl:.2f}"  # none: β = 0 loads no reference
        print(f"| {variant} | {','.join(seeds)} | {100 * mean:.1f}% ± {100 * half:.1f} | "
              f"{', '.join(f'{100 * v:.1f}' for v in final)} | {100 * gain:+.1f} | {kl_text} | {wall:.0f} s |")
    starts = {s: r[0] for by_seed in rows.values() for s, r in by_seed.items()}
    print("\nSFT model (the evaluation before the first update), by seed: "
          + ", ".join(f"{s}: {100 * v:.1f}%" for s, v in sorted(starts.items())))


if __name__ == "__main__":
    main(*sys.argv[1:3])
