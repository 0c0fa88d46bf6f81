"""The tables of docs/sft.md, reward_model.md, rlhf_ppo.md, dpo.md and grpo.md, from the newest run of each stage
of benchmarks/rlhf_pipeline.sh: sft's and the reward model's last evaluation, then, for every model after them,
gold accuracy, gold score, reward-model score and KL to the SFT model of completions sampled at temperature 1 on
the 512 eval prompts, at the end of the run. The SFT row is rlhf_ppo.py's evaluation before its first update.

    python benchmarks/summarize_rlhf.py runs
"""
import glob
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROWS = [("rlhf_ppo", "PPO (`rlhf_ppo.py`)"), ("dpo", "DPO (`dpo.py`)"), ("grpo", "GRPO (`grpo.py`), gold reward"),
        ("rlhf_ppo_kl0", "PPO with `--kl-coef 0`"), ("grpo_rm", "GRPO, `--reward-model-path models/reward_model`")]


def scalars(run_dir):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def newest(root, exp_name):
    runs = sorted(glob.glob(os.path.join(root, f"{exp_name}__*")), key=os.path.getmtime)
    return scalars(runs[-1]) if runs else None


def main(root):
    sft, rm = newest(root, "sft"), newest(root, "reward_model")
    if sft:
        print(f"sft.py: gold accuracy sampled {100 * sft['eval/gold_accuracy'][-1]:.1f}%, greedy "
              f"{100 * sft['eval/gold_accuracy_greedy'][-1]:.1f}%, eval loss {sft['eval/loss'][-1]:.4f}")
    if rm:
        print(f"reward_model.py: pairwise accuracy {100 * rm['eval/accuracy'][-1]:.1f}%, gold correlation "
              f"{rm['eval/gold_correlation'][-1]:.3f}")
    print("| model | gold accuracy | gold score | reward-model score | KL to SFT (nats per completion) |")
    print("|-|-|-|-|-|")
    first = True
    for exp_name, label in ROWS:
        logs = newest(root, exp_name)
        if logs is None:
            continue
        at = [(0, "SFT (`models/sft`)"), (-1, label)] if first else [(-1, label)]
        first = False
        for i, name in at:
            values = [logs[tag][i] if tag in logs else float("nan")
                      for tag in ("eval/gold_accuracy", "eval/gold_score", "eval/score", "eval/kl")]
            print(f"| {name} | {100 * values[0]:.1f}% | {values[1]:.3f} | {values[2]:.2f} | {values[3]:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs")
