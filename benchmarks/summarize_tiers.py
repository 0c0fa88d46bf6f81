"""The final eval/gold_accuracy (sft: also the greedy one; reward_model and dpo: eval/accuracy on pairs) of every run tiers_accuracy.sh made, per script and checkout:
each seed, the mean, and the difference of the means.

    python benchmarks/summarize_tiers.py benchmarks/tiers/before benchmarks/tiers/after
"""
import glob
import os
import statistics
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def final(run_dir, tag):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)[-1].value if tag in acc.Tags()["scalars"] else None


def results(out):
    """{(script, tag): {seed: value}} of the runs under out/runs (run names <exp>__<seed>__<time>)."""
    found = {}
    for run_dir in sorted(glob.glob(os.path.join(out, "runs", "*"))):
        script, seed, _ = os.path.basename(run_dir).split("__")
        for tag in ("eval/gold_accuracy", "eval/gold_accuracy_greedy", "eval/accuracy"):
            value = final(run_dir, tag)
            if value is not None:
                found.setdefault((script, tag), {})[int(seed)] = value
    return found


def main():
    before, after = results(sys.argv[1]), results(sys.argv[2])
    print("| script | tag | before (seeds) | before mean | after (seeds) | after mean | after − before |\n|-|-|-|-|-|-|-|")
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, {}), after.get(key, {})
        row = [" ".join(f"{100 * v:.1f}" for _, v in sorted(x.items())) for x in (b, a)]
        means = [statistics.mean(x.values()) * 100 if x else float("nan") for x in (b, a)]
        print(f"| {key[0]} | {key[1]} | {row[0]} | {means[0]:.1f} | {row[1]} | {means[1]:.1f} | {means[1] - means[0]:+.1f} |")


if __name__ == "__main__":
    main()
