"""The LoRA vs full fine-tuning table of docs/scaling.md from benchmarks/lora_vs_full.sh's runs: the final
eval/gold_accuracy (512 eval prompts, sampled at temperature 1), the trained parameters each run printed, its
wall time and peak resident memory.

    python benchmarks/summarize_lora.py runs benchmarks/lora_vs_full
"""
import glob
import os
import re
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def newest(root, exp_name):
    runs = sorted(glob.glob(os.path.join(root, f"{exp_name}__*")), key=os.path.getmtime)
    return runs[-1] if runs else None


def main(root, out):
    print("| script | training | gold accuracy | trained parameters | wall time | peak memory (RSS) |")
    print("|-|-|-|-|-|-|")
    for script in ("dpo", "rlhf_ppo", "grpo"):
        for mode, name, exp in (("full", script, f"{script}_full"), ("LoRA r=16", f"{script}_lora", f"{script}_lora")):
            run = newest(root, exp)
            if run is None or not os.path.exists(os.path.join(out, f"{name}.time")):
                continue
            acc = EventAccumulator(run, size_guidance={"scalars": 0})
            acc.Reload()
            accuracy = acc.Scalars("eval/gold_accuracy")[-1].value
            log = open(os.path.join(out, f"{name}.log")).read()
            trained = re.search(r"\(([\d,]+) trained\)", log).group(1)
            seconds, kib = open(os.path.join(out, f"{name}.time")).read().split()
            print(f"| `{script}.py` | {mode} | {100 * accuracy:.1f}% | {trained} | {float(seconds):.0f} s | "
                  f"{int(kib) / 1024:,.0f} MiB |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
