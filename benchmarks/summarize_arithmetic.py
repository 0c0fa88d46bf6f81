"""The arithmetic task's table (docs/rlhf_results.md) from the runs of benchmarks/arithmetic.sh: accuracy of
the final answer (numeric_match: the number after `####` equals the target's) of completions sampled at
temperature 1 on the 512 held-out questions, after sft.py (grpo.py's evaluation before its first update),
after grpo.py and after rlhf_ppo.py; the KL to the SFT model; each stage's wall time.

    python benchmarks/summarize_arithmetic.py benchmarks/arithmetic runs
"""
import glob
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAG = "eval/rewards/numeric_match"


def scalars(run_dir, tag):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def newest(runs, exp_name, seed):
    found = sorted(glob.glob(os.path.join(runs, f"{exp_name}__{seed}__*")), key=os.path.getmtime)
    return found[-1] if found else None


def main(out, runs):
    print("| seed | after sft.py | after grpo.py | after rlhf_ppo.py | KL to SFT: grpo, rlhf_ppo | wall time: sft, grpo, rlhf_ppo |")
    print("|-|-|-|-|-|-|")
    for seed_dir in sorted(glob.glob(os.path.join(out, "seed*"))):
        seed = seed_dir.rsplit("seed", 1)[1]
        times = dict(line.split() for line in open(os.path.join(seed_dir, "times.txt")))
        grpo, ppo = newest(runs, "arith_grpo", seed), newest(runs, "arith_rlhf_ppo", seed)
        if grpo is None or ppo is None or "rlhf_ppo" not in times:
            print(f"| {seed} | (runs missing or unfinished) |")
            continue
        g, p = scalars(grpo, TAG), scalars(ppo, TAG)
        kl = f"{scalars(grpo, 'eval/kl')[-1]:.2f}, {scalars(ppo, 'eval/kl')[-1]:.2f}"
        print(f"| {seed} | {100 * g[0]:.1f}% | {100 * g[-1]:.1f}% | {100 * p[-1]:.1f}% | {kl} | "
              f"{times['sft']} s, {times['grpo']} s, {times['rlhf_ppo']} s |")


if __name__ == "__main__":
    main(*(sys.argv[1:] if len(sys.argv) > 2 else ("benchmarks/arithmetic", "runs")))
