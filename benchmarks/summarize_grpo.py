"""The README's GRPO table from the newest run of each grpo.py variant (and rlhf_ppo.py, dpo.py when present):
gold accuracy, gold score and KL to the SFT model of completions sampled at temperature 1 on the 512 eval
prompts, at the end of each run.

    python benchmarks/summarize_grpo.py runs
"""
import glob
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RUNS = [("rlhf_ppo", "PPO (`rlhf_ppo.py`)"), ("dpo", "DPO (`dpo.py`)"), ("grpo", "GRPO (`grpo.py`), gold reward"),
        ("grpo_rm", "GRPO, `--reward-model-path models/reward_model`"), ("rloo", "RLOO, `--advantage rloo`"),
        ("grpo_noscale", "GRPO, `--no-scale-rewards`"), ("grpo_dapo", "GRPO, `--loss-type dapo`"),
        ("dr_grpo", "Dr. GRPO, `--loss-type dr_grpo --no-scale-rewards`")]


def last(run_dir, tag):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)[-1].value if tag in acc.Tags()["scalars"] else float("nan")


def main(root):
    print("| run | gold accuracy | gold score | KL to SFT (nats per completion) |")
    print("|-|-|-|-|")
    for exp_name, label in RUNS:
        runs = sorted(glob.glob(os.path.join(root, f"{exp_name}__*")), key=os.path.getmtime)
        if runs:
            accuracy, gold, kl = (last(runs[-1], t) for t in ("eval/gold_accuracy", "eval/gold_score", "eval/kl"))
            print(f"| {label} | {100 * accuracy:.1f}% | {gold:.3f} | {kl:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs")
