"""The learning curves of the docs pages (docs/curves/*.svg), from the TensorBoard runs of the benchmark scripts.

    python benchmarks/plot_curves.py                  # reads benchmarks/runs and runs/, writes docs/curves/*.svg

One figure per script card: the mean over seeds with a band from the lowest to the highest seed, and
a dashed line for a published reference figure where there is one. RL curves are the return of the
last 100 training episodes against environment steps; LM curves are the sampled evaluation against
the script's own step (optimizer steps, PPO iterations, GRPO batches).

It refuses to mix runs: two runs of one seed in a group, a run that stopped before its last step
(killed early), or a run without its final evaluation is an error naming the run directory.
"""
import collections
import glob
import os
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "curves"  # the same runs give the same file
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RL_RUNS, LM_RUNS, OUT = "benchmarks/runs", "runs", "docs/curves"

# CleanRL's published ppo.py figures, drawn as dashed reference lines: the same env ids (under gym, not gymnasium 1.x)
# and hyperparameters. Its MuJoCo figures are for the v4 envs, so they are not drawn on the v5 panels: there the
# comparison is this repo's runs with CleanRL's settings (ppo_continuous.sh cleanrl)
CLEANRL = {"CartPole-v1": 490.04, "Acrobot-v1": -86.36}

# the legend of a run group: its flags (the exp name the benchmark scripts gave it)
LABELS = {"grpo_rm": "--reward-model-path", "rloo": "--advantage rloo", "rlhf_ppo_kl0": "--kl-coef 0",
          "ppo_continuous_cleanrl": "CleanRL's settings"}  # --log-std-init 0 --no-bootstrap-truncation

# (figure file, [(panel title, runs glob under RL_RUNS or LM_RUNS, tag, y label)])
FIGURES = {
    "ppo_clip.svg": [("CartPole-v1", "rl:CartPole-v1__ppo_clip__*", "return", "episodic return"),
                     ("Acrobot-v1", "rl:Acrobot-v1__ppo_clip__*", "return", "episodic return")],
    "ppo_kl.svg": [("CartPole-v1, adaptive KL", "rl:CartPole-v1__ppo_kl__*", "return", "episodic return"),
                   ("β (charts/kl_coef)", "rl:CartPole-v1__ppo_kl__*", "charts/kl_coef", "β, log scale")],
    "ppo_continuous.svg": [(env, f"rl:{env}__ppo_continuous__*,{env}__ppo_continuous_cleanrl__*", "return",
                            "episodic return")
                           for env in ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5")],
    "sft.svg": [("sampled gold accuracy", "lm:sft__*", "eval/gold_accuracy", "eval/gold_accuracy"),
                ("eval loss", "lm:sft__*", "eval/loss", "eval/loss")],
    "reward_model.svg": [("held-out pairwise accuracy", "lm:reward_model__*", "eval/accuracy", "eval/accuracy"),
                         ("correlation with the gold score", "lm:reward_model__*", "eval/gold_correlation",
                          "eval/gold_correlation")],
    "rlhf_ppo.svg": [("gold accuracy", "lm:rlhf_ppo__*,rlhf_ppo_kl0__*", "eval/gold_accuracy", "eval/gold_accuracy"),
                     ("KL to the SFT model", "lm:rlhf_ppo__*,rlhf_ppo_kl0__*", "eval/kl",
                      "eval/kl (nats per completion)")],
    "dpo.svg": [("gold accuracy", "lm:dpo__*", "eval/gold_accuracy", "eval/gold_accuracy"),
                ("KL to the SFT model", "lm:dpo__*", "eval/kl", "eval/kl (nats per completion)")],
    "grpo.svg": [("gold accuracy", "lm:grpo__*,grpo_rm__*,rloo__*", "eval/gold_accuracy", "eval/gold_accuracy"),
                 ("KL to the SFT model", "lm:grpo__*,grpo_rm__*,rloo__*", "eval/kl", "eval/kl (nats per completion)")],
    "agent_grpo.svg": [("treasure hunt: the chest opened", "lm:agent_hunt__*", "eval/gold_accuracy",
                        "eval/gold_accuracy"),
                       ("failed calls per episode", "lm:agent_hunt__*", "eval/failure_count", "eval/failure_count")],
}

def load(run_dir):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    args = {}
    if "hyperparameters/text_summary" in acc.Tags()["tensors"]:
        text = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
        args = dict(line.strip("|").split("|", 1) for line in text.splitlines()[2:])
    return scalars, args


def check(run_dir, scalars, args, rl):
    """A run must have finished: its last step logged and its final evaluation written."""
    name = os.path.basename(run_dir)
    if rl:
        batch = int(args["num_envs"]) * int(args["num_steps"])
        last = int(args["total_timesteps"]) // batch * batch
        if not scalars.get("charts/SPS") or scalars["charts/SPS"][-1][0] != last:
            sys.exit(f"error: {name} stopped before step {last:,} (killed early?); rerun or delete it")
        if int(args["eval_episodes"]) > 0 and "eval/episodic_return" not in scalars:
            sys.exit(f"error: {name} has no eval/episodic_return (killed before its evaluation?)")
    else:
        length = next(key for key in ("num_batches", "num_iterations", "max_steps") if key in args)  # old grpo runs (whose num_iterations was μ), ppo and grpo, the rest
        last = int(args[length])
        evals = [tag for tag in scalars if tag.startswith("eval/")]
        if not evals or max(scalars[evals[0]])[0] != last:
            sys.exit(f"error: {name} has no evaluation at its last step {last} (killed early?)")


def runs_of(pattern):
    """{group: {seed: scalars}} of the finished runs matching "rl:" or "lm:" and comma-separated globs;
    refuses duplicate seeds."""
    kind, globs = pattern.split(":", 1)
    root = RL_RUNS if kind == "rl" else LM_RUNS
    by_group = collections.defaultdict(dict)
    for run_dir in sorted(d for g in globs.split(",") for d in glob.glob(os.path.join(root, g))):
        parts = os.path.basename(run_dir).split("__")
        group, seed = tuple(parts[:-2]), int(parts[-2])
        scalars, args = load(run_dir)
        check(run_dir, scalars, args, kind == "rl")
        if seed in by_group[group]:
            sys.exit(f"error: two runs of {'__'.join(group)} with seed {seed} in {root}: keep one")
        by_group[group][seed] = scalars
    return by_group


def curve(scalars, tag):
    """(x, y): for "return", the mean of the last 100 training episodes at each episode end."""
    if tag == "return":
        steps, values = zip(*scalars["charts/episodic_return"])
        values = np.array(values)
        smoothed = [values[max(0, i - 99): i + 1].mean() for i in range(len(values))]
        return np.array(steps), np.array(smoothed)
    steps, values = zip(*scalars[tag])
    return np.array(steps), np.array(values)


def draw(ax, title, pattern, tag, ylabel):
    groups = runs_of(pattern)
    if not groups:
        ax.set_title(f"{title}: no runs")
        return False
    for i, (group, seeds) in enumerate(sorted(groups.items())):
        curves = [curve(seeds[s], tag) for s in sorted(seeds)]
        grid = np.linspace(max(c[0][0] for c in curves), min(c[0][-1] for c in curves), 200)
        ys = np.array([np.interp(grid, x, y) for x, y in curves])
        label = f"{LABELS.get(group[-1], 'defaults')} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
        ax.plot(grid, ys.mean(0), color=f"C{i}", label=label)
        if len(seeds) > 1:
            ax.fill_between(grid, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.2)
    env = title.split(",")[0]
    if tag == "return" and env in CLEANRL:
        ax.axhline(CLEANRL[env], color="black", linestyle="--", linewidth=1,
                   label=f"CleanRL ppo.py, gym ({CLEANRL[env]:,.0f})")
    if tag == "charts/kl_coef":
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("environment steps" if pattern.startswith("rl:") else "step")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.legend(fontsize=7)
    if pattern.startswith("rl:"):
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    return True


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, panels in FIGURES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
        drawn = [draw(ax, *panel) for ax, panel in zip(axes[0], panels)]
        if any(drawn):
            fig.tight_layout()
            fig.savefig(os.path.join(OUT, name), metadata={"Date": None})  # no date: the same runs, the same file
            print(f"wrote {OUT}/{name}")
        plt.close(fig)


if __name__ == "__main__":
    main()
