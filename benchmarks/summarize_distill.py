"""docs/distill.md's table and figure, from the runs of benchmarks/distill.sh: for each row (the student after SFT,
after grpo.py, after distill.py's three forms, and the teacher) the gold accuracy of its saved model on each seed's
512 eval prompts, sampled at temperature 1 and greedy (the same evaluation for every row: distill.py's `generate`,
torch seeded with the seed), the mean, a 95% t-interval and each seed, and the run's wall time; with a figure path,
the sampled accuracy each run logged against the completions it had sampled (and its mean over the seeds, printed).

    python benchmarks/summarize_distill.py benchmarks/distill [docs/curves/distill.svg]
"""
import glob
import math
import os
import sys

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import distill  # noqa: E402  the evaluation is distill.py's own sampler and task

# row: (the models' directory, seed → name; its label; the completions one logged step samples)
ROWS = [("student_s{}", "student after SFT (sft.py --n-layer 1 --n-embd 64)", None),
        ("grpo_s{}", "grpo.py (defaults: 120 × 256 completions)", 256),
        ("sampled_token_s{}", "distill.py --sampled-token (480 × 64)", 64),
        ("beta1_s{}", "distill.py --beta 1 (reverse KL, 480 × 64)", 64),
        ("beta0.5_s{}", "distill.py --beta 0.5 (JSD, 480 × 64)", 64),
        ("teacher", "teacher (sft.py, then grpo.py, 3 layers, 128 wide)", None)]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, 0.975 quantile, by degrees of freedom


def mean(values):
    return sum(values) / len(values)


def interval(values):
    if len(values) < 2:
        return float("nan")
    sd = math.sqrt(sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1))
    return T975[len(values) - 1] * sd / math.sqrt(len(values))


@torch.no_grad()
def accuracy(path, seed):
    """(sampled, greedy) gold accuracy of the model at `path` on the built-in task's eval prompts of `seed`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = distill.task_rows(seed, "eval", 512, distill.distillation_row)
    prompts = [distill.encode_prompt(tokenizer, row["prompt"]) for row in rows]
    stop_ids = distill.stop_token_ids(tokenizer)
    torch.manual_seed(seed)
    out = []
    for greedy in (False, True):
        sequences, _, width, _, _ = distill.generate(model, prompts, tokenizer.pad_token_id, stop_ids, 12, 1.0, greedy)
        completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
        out.append(sum(c == row["target"] for c, row in zip(completions, rows)) / len(rows))
    return out


def curve(out_dir, name):
    """[(step, eval/gold_accuracy)] the run named `name` logged."""
    run_dir, = glob.glob(os.path.join(out_dir, "runs", f"{name}__*"))
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("eval/gold_accuracy")]


def main(out_dir, figure=None):
    torch.set_num_threads(1)
    times = dict(line.split() for line in open(os.path.join(out_dir, "times.txt")))
    seeds = sorted(int(name[len("grpo_s"):]) for name in times if name.startswith("grpo_s"))
    print("| row | gold accuracy, sampled (95% interval) | per seed | greedy | per seed | wall time, s (per seed) |")
    print("|-|-|-|-|-|-|")
    for pattern, label, _ in ROWS:
        names = [pattern.format(seed) for seed in seeds]
        sampled, greedy = zip(*(accuracy(os.path.join(out_dir, name), seed) for name, seed in zip(names, seeds)))
        walls = [float(times[name]) for name in dict.fromkeys(names)]
        wall = "—" if "failed" in walls else f"{mean(walls):.0f} ({', '.join(f'{w:.0f}' for w in walls)})"
        if pattern == "teacher":
            wall = f"{float(times['teacher_sft']) + float(times['teacher']):.0f} (sft.py + grpo.py)"
        print(f"| {label} | {100 * mean(sampled):.1f}% ± {100 * interval(sampled):.1f} | "
              f"{', '.join(f'{100 * v:.1f}' for v in sampled)} | {100 * mean(greedy):.1f}% ± "
              f"{100 * interval(greedy):.1f} | {', '.join(f'{100 * v:.1f}' for v in greedy)} | {wall} |")
    if figure:
        plot(out_dir, seeds, figure)


def plot(out_dir, seeds, figure):
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "curves"  # the same runs give the same file
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for pattern, label, per_step in ROWS:
        if per_step is None:
            continue
        curves = [curve(out_dir, pattern.format(seed)) for seed in seeds]
        x = [step * per_step for step, _ in curves[0]]
        values = [[100 * v for _, v in c] for c in curves]
        middle = [mean(column) for column in zip(*values)]
        print(f"{label.split(' (')[0]}: " + ", ".join(f"{n:,} {v:.1f}%" for n, v in zip(x, middle)))
        line, = ax.plot(x, middle, label=label.split(" (")[0], marker=".")
        ax.fill_between(x, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)], color=line.get_color(),
                        alpha=0.15)
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("gold accuracy (sampled), %")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(figure)
    print(f"\nwrote {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
