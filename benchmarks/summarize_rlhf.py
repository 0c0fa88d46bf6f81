"""The README's RLHF table from the newest runs of rlhf_ppo.py, rlhf_ppo_kl0 and dpo.py:
gold accuracy, gold score, reward-model score and KL to the SFT model of completions sampled at
temperature 1 on the 512 eval prompts. The SFT row is rlhf_ppo.py's evaluation before its first update.

    python benchmarks/summarize_rlhf.py runs
"""
import glob
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = ["eval/gold_accuracy", "eval/gold_score", "eval/score", "eval/kl"]


def evals(run_dir, first=False):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [acc.Scalars(tag)[0 if first else -1].value for tag in TAGS]


def newest(root, exp_name):
    runs = sorted(glob.glob(os.path.join(root, f"{exp_name}__*")), key=os.path.getmtime)
    return runs[-1] if runs else None


def main(root):
    rows = []
    ppo, ppo_kl0, dpo = newest(root, "rlhf_ppo"), newest(root, "rlhf_ppo_kl0"), newest(root, "dpo")
    if ppo:
        rows.append(("SFT (`models/sft`)", evals(ppo, first=True)))
        rows.append(("PPO (`rlhf_ppo.py`)", evals(ppo)))
    if dpo:
        rows.append(("DPO (`dpo.py`)", evals(dpo)))
    if ppo_kl0:
        rows.append(("PPO with `--kl-coef 0`", evals(ppo_kl0)))
    print("| model | gold accuracy | gold score | reward-model score | KL to SFT (nats per completion) |")
    print("|-|-|-|-|-|")
    for name, (accuracy, gold, score, kl) in rows:
        print(f"| {name} | {100 * accuracy:.1f}% | {gold:.3f} | {score:.2f} | {kl:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs")
