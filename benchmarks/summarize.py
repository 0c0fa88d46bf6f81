"""The tables and figures of the docs pages, from the runs of the benchmark scripts beside this file. One command
per page's figure; each reads the runs its script wrote and prints the table as the page shows it.

    python benchmarks/summarize.py ppo benchmarks/runs [--beta-figure docs/ppo_kl_beta.svg]   # ppo_discrete.sh, ppo_continuous.sh
    python benchmarks/summarize.py trust_region benchmarks/trust_region/runs docs/curves/trust_region.svg  # ppo_trust_region.sh
    python benchmarks/summarize.py rlhf runs                                     # rlhf_pipeline.sh
    python benchmarks/summarize.py variants benchmarks/variants/arithmetic [runs.csv] [figure.svg]  # grpo_variants.sh
    python benchmarks/summarize.py off_policy benchmarks/off_policy/grpo [docs/curves/grpo_off_policy.svg]  # off_policy.sh
    python benchmarks/summarize.py distill benchmarks/distill [docs/curves/distill.svg]  # distill.sh
    python benchmarks/summarize.py kto benchmarks/kto [docs/curves/kto.svg]        # rlhf_pipeline.sh kto

ppo: docs/ppo_clip.md's, ppo_kl.md's and ppo_continuous.md's tables: mean ± std over seeds of the mean return of the
last 100 training episodes. With --beta-figure it also draws the adaptive β of the ppo_kl.py runs (log scale) and
the KL of each update as a plain SVG, and prints per run the 5th and 95th percentiles of the KL per update, the share
of updates below d_targ/1.5 (after which β halves), how many doubled β, and where β stays below 1e-6. Groups run
directories named <env>__<exp>__<seed>__<time> by (env, exp) and refuses, as plot_curves.py does, two runs of one
seed in a group, a run that stopped before its last step and one without its evaluation.

trust_region: docs/ppo_kl.md's trust-region table and figure (PPO paper, Table 1, on discrete tasks): per variant and
env, the mean over seeds and its 95% t-interval of the last-100-episode return and of the learning curve's mean
height, and the median over all updates of the exact KL each update moved the policy by (`losses/kl`); per env, the
learning curves, that KL per update against the targets, and β of the adaptive runs.

rlhf: the tables of docs/sft.md, reward_model.md, rlhf_ppo.md, dpo.md and grpo.md, from the newest run of each
stage: sft's and the reward model's last evaluation, then, for every model after them, gold accuracy, gold score,
reward-model score and KL to the SFT model of completions sampled at temperature 1 on the 512 eval prompts, at the end
of the run. The SFT row is rlhf_ppo.py's evaluation before its first update.

variants: docs/grpo.md's variants tables: for each variant, the final evaluation's accuracy (gold accuracy, else
eval/rewards/numeric_match), its gain over the SFT model, the KL to the SFT model, pass@8 (with --eval-num-samples
8), the rollout's entropy per token, and the wall time, over the seeds found. With 2 or more seeds the interval is the
95% t-interval of the mean over seeds; with one, the 95% binomial interval over the eval prompts. With a CSV path,
each run's numbers are appended to it too; with a figure path, the entropy curves of the entropy methods at the
defaults and in the harsh setting, and the harsh setting's pass@8. rlhf_ppo.py's variants (docs/rlhf_ppo.md) add a
table of the critic's explained variance and value loss, and their figure is plot_value's.

off_policy: docs/grpo.md's off-policy table and figure (and docs/rlhf_ppo.md's table): for each rollout lag K and
correction, the final gold accuracy over the seeds (mean, 95% t-interval, each seed), the sampler's distance from
π_old over the run, the share of tokens the correction leaves out or the weight's mean, and the KL to the SFT model;
with a figure path, the accuracy against iterations, one panel per lag.

distill: docs/distill.md's table and figure: for each row the gold accuracy of its saved model on each seed's 512
eval prompts, sampled at temperature 1 and greedy (distill.py's `generate`, torch seeded with the seed), the mean, a
95% t-interval and each seed, and the run's wall time; with a figure path, the sampled accuracy each run logged
against the completions it had sampled.

kto: docs/kto.md's table and figure: for each row (kto.py, dpo.py, kto.py at 1:4), the final evaluation's gold
accuracy over the seeds (mean, 95% t-interval, each seed), the implied reward's accuracy on the held-out pairs, the
KL to the SFT model and the wall time; with a figure path, the gold accuracy against the optimizer step.
"""
import collections
import glob
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t(0.975, df)


def scalars(run_dir):
    """{tag: [(step, value), ...]} of one TensorBoard run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mean(values):
    return sum(values) / len(values)


def half_width(values):
    """The half-width of the 95% t-interval of the mean of `values` (NaN for one value)."""
    if len(values) < 2:
        return float("nan")
    sd = math.sqrt(sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1))
    return T975[len(values) - 1] * sd / math.sqrt(len(values))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "curves"  # the same runs give the same file
    import matplotlib.pyplot as plt

    return plt


def plot_curves():
    """benchmarks/plot_curves.py (its run loading and checks), imported when a table needs it: its pyplot is slow."""
    sys.path.insert(0, HERE)
    import plot_curves

    return plot_curves


# ------------------------------------------------------------------------- ppo (ppo_discrete.sh, ppo_continuous.sh)
def ppo(root):
    import numpy as np

    curves = plot_curves()
    groups = collections.defaultdict(dict)
    for run_dir in sorted(glob.glob(os.path.join(root, "*__*__*__*"))):
        env_id, exp_name, seed, _ = os.path.basename(run_dir).split("__")
        logs, args = curves.load(run_dir)
        curves.check(run_dir, logs, args, rl=True)
        if int(seed) in groups[(env_id, exp_name)]:
            sys.exit(f"error: two runs of {env_id}__{exp_name} with seed {seed} in {root}: keep one")
        returns = [v for _, v in logs["charts/episodic_return"]]
        evals = [v for _, v in logs.get("eval/episodic_return", [])]
        groups[(env_id, exp_name)][int(seed)] = (np.mean(returns[-100:]), logs["charts/SPS"][-1][1],
                                                 evals[-1] if evals else np.nan)
    print("| script | env | seeds | last-100-episode return (mean ± std over seeds) | per seed | eval return | SPS |")
    print("|-|-|-|-|-|-|-|")
    for (env_id, exp_name), runs in sorted(groups.items()):
        seeds = sorted(runs)
        means, sps, evals = (np.array([runs[s][i] for s in seeds]) for i in range(3))
        print(f"| {exp_name}.py | {env_id} | {','.join(map(str, seeds))} | {means.mean():,.2f} ± {means.std():,.2f} "
              f"| {' / '.join(f'{m:,.1f}' for m in means)} | {np.mean(evals):,.2f} | {np.mean(sps):,.0f} |")


W, H, PAD = 720, 260, 50
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def panel(series, y0, title, lo, hi, hlines=()):
    """One log-scale panel: series = [(label, [(step, value), ...])], dashed lines at hlines = [(value, label)]."""
    max_step = max(s for _, pts in series for s, _ in pts)
    x = lambda s: PAD + (W - 2 * PAD) * s / max_step  # noqa: E731
    y = lambda v: y0 + H - PAD - (H - 2 * PAD) * (math.log10(max(v, 10**lo)) - lo) / (hi - lo)  # noqa: E731
    out = [f'<text x="{PAD}" y="{y0 + 20}" font-size="14">{title}</text>',
           f'<rect x="{PAD}" y="{y0 + PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" fill="none" stroke="#999"/>']
    for e in range(lo, hi + 1):
        out.append(f'<text x="{PAD - 5}" y="{y(10**e) + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    for value, label in hlines:
        out.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="black" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{W - PAD - 4}" y="{y(value) - 3:.1f}" font-size="10" text-anchor="end">{label}</text>')
    for i, (label, pts) in enumerate(series):
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLORS[i % 6]}" stroke-width="1"/>')
        out.append(f'<text x="{W - PAD + 5}" y="{y0 + PAD + 14 * i + 10}" font-size="10" fill="{COLORS[i % 6]}">{label}</text>')
    out.append(f'<text x="{W / 2}" y="{y0 + H - 15}" font-size="10" text-anchor="middle">global step (0 to {max_step:,})</text>')
    return out


def beta_figure(root, out_path):
    betas, kls = [], []
    for run_dir in sorted(glob.glob(os.path.join(root, "CartPole-v1__ppo_kl*"))):
        logs = scalars(run_dir)
        _, exp_name, seed, _ = os.path.basename(run_dir).split("__")
        label = f"{exp_name.replace('ppo_kl_', '') if exp_name != 'ppo_kl' else 'defaults'} s{seed}"
        betas.append((label, logs["charts/kl_coef"]))
        kls.append((label, logs["losses/kl"]))
        target = 0.01  # the default d_targ, which both of ppo_discrete.sh's ppo_kl.py runs use
        d = sorted(v for _, v in kls[-1][1])
        beta = [v for _, v in betas[-1][1]]  # the β each update was made with
        first_small = next((i + 1 for i in range(len(beta)) if all(b < 1e-6 for b in beta[i:])), None)
        gone = (f"β < 1e-6 from update {first_small} (step {betas[-1][1][first_small - 1][0]:,})" if first_small
                else f"β between {min(beta):.2g} and {max(beta):.2g} throughout")  # the penalty binds to the end
        print(f"{label}: KL per update p5 {d[len(d) // 20]:.1e}, p95 {d[len(d) * 19 // 20]:.1e}; "
              f"{sum(v < target / 1.5 for v in d) / len(d):.1%} of {len(d)} updates below d_targ/1.5; "
              f"{sum(v > target * 1.5 for v in d)} doubled β; {gone}")
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + 80}" height="{2 * H}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>']
    lowest = min(v for _, pts in betas for _, v in pts)
    svg += panel(betas, 0, "ppo_kl.py CartPole-v1: β (log scale)", max(-12, math.floor(math.log10(max(lowest, 1e-30)))),
                 max(1, math.ceil(math.log10(max(v for _, pts in betas for _, v in pts)))))
    svg += panel(kls, H, "KL[π_old ‖ π_new] after each update (log scale)", -6, -1,
                 [(0.01 / 1.5, "d_targ/1.5: below it β halves"), (0.01 * 1.5, "1.5·d_targ: above it β doubles")])
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(svg + ["</svg>"]))
    print(f"wrote {out_path}")


# ------------------------------------------------------------------------- trust_region (ppo_trust_region.sh)
# (exp name, label) in the order of the paper's Table 1
TRUST_REGION_VARIANTS = [
    ("tr_none", "no clipping or penalty"), ("tr_clip", "clipping, ε = 0.2"),
    ("tr_adaptive_0.003", "adaptive KL, d_targ = 0.003"), ("tr_adaptive_0.01", "adaptive KL, d_targ = 0.01"),
    ("tr_adaptive_0.03", "adaptive KL, d_targ = 0.03"), ("tr_fixed_0.3", "fixed KL, β = 0.3"),
    ("tr_fixed_1", "fixed KL, β = 1"), ("tr_fixed_3", "fixed KL, β = 3")]
TRUST_REGION_ENVS = ["CartPole-v1", "Acrobot-v1"]


def mean_and_interval(values):
    """'mean [low, high]': the mean and its 95% confidence interval over seeds."""
    half = half_width(values)
    return f"{mean(values):.1f} [{mean(values) - half:.1f}, {mean(values) + half:.1f}]"


def trust_region(root, out_path):
    import matplotlib.ticker
    import numpy as np

    curves = plot_curves()
    curves.RL_RUNS = root
    variants, envs = TRUST_REGION_VARIANTS, TRUST_REGION_ENVS
    runs = {(env, exp): curves.runs_of(f"rl:{env}__{exp}__*").get((env, exp), {}) for env in envs
            for exp, _ in variants}
    envs = [env for env in envs if any(runs[(env, exp)] for exp, _ in variants)]
    if not envs:
        sys.exit(f"error: no runs of benchmarks/ppo_trust_region.sh in {root}")
    print("| variant | seeds | " + " | ".join(f"{env}: final return | curve mean | median KL per update" for env in envs)
          + " |")
    print("|-|-|" + "-|-|-|" * len(envs))
    for exp, label in variants:
        if not any(runs[(env, exp)] for env in envs):
            continue
        cells = [",".join(str(s) for s in sorted(set().union(*(runs[(env, exp)] for env in envs))))]
        for env in envs:
            seeds = runs[(env, exp)]
            if not seeds:
                cells += ["", "", ""]
                continue
            returns = [curves.curve(s, "return") for s in seeds.values()]
            finals = [float(y[-1]) for _, y in returns]
            heights = [float(np.interp(np.linspace(x[0], x[-1], 200), x, y).mean()) for x, y in returns]
            kls = np.concatenate([[v for _, v in s["losses/kl"]] for s in seeds.values()])
            cells += [mean_and_interval(finals), mean_and_interval(heights), f"{np.median(kls):.1e}"]
        print(f"| {label} | " + " | ".join(cells) + " |")

    plt = pyplot()
    smooth = lambda v, n=20: np.array([np.mean(v[max(0, i - n + 1): i + 1]) for i in range(len(v))])  # noqa: E731
    fig, axes = plt.subplots(len(envs), 3, figsize=(16, 3.4 * len(envs)), squeeze=False)
    for row, env in enumerate(envs):
        return_ax, kl_ax, beta_ax = axes[row]
        for i, (exp, label) in enumerate(variants):
            seeds = runs[(env, exp)]
            if not seeds:
                continue
            returns = [curves.curve(s, "return") for s in seeds.values()]
            grid = np.linspace(max(x[0] for x, _ in returns), min(x[-1] for x, _ in returns), 200)
            ys = np.array([np.interp(grid, x, y) for x, y in returns])
            return_ax.plot(grid, ys.mean(0), color=f"C{i}", label=label, linewidth=1)
            return_ax.fill_between(grid, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.12)
            steps = [t for t, _ in next(iter(seeds.values()))["losses/kl"]]
            kl = np.mean([[v for _, v in s["losses/kl"]] for s in seeds.values()], axis=0)
            kl_ax.plot(steps, smooth(kl), color=f"C{i}", label=label, linewidth=1)
            if exp.startswith("tr_adaptive"):
                kl_ax.axhline(float(exp.split("_")[-1]), color=f"C{i}", linestyle="--", linewidth=0.8)
                beta = np.exp(np.mean([np.log(np.maximum([v for _, v in s["charts/kl_coef"]], 1e-30))
                                       for s in seeds.values()], axis=0))
                beta_ax.plot(steps, beta, color=f"C{i}", label=label, linewidth=1)
        return_ax.set_title(f"{env}: last-100-episode return (mean over seeds, min-max band)", fontsize=9)
        kl_ax.set_yscale("log")
        kl_ax.set_title(f"{env}: KL of each update (mean over seeds, 20-update mean); dashed: d_targ", fontsize=9)
        beta_ax.set_yscale("log")
        beta_ax.set_title(f"{env}: β of the adaptive runs (geometric mean over seeds)", fontsize=9)
        for ax in (return_ax, kl_ax, beta_ax):
            ax.set_xlabel("environment steps")
            ax.legend(fontsize=6)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    fig.tight_layout()
    fig.savefig(out_path, metadata={"Date": None})
    print(f"wrote {out_path}")


# ------------------------------------------------------------------------- rlhf (rlhf_pipeline.sh)
RLHF_ROWS = [("rlhf_ppo", "PPO (`rlhf_ppo.py`)"), ("dpo", "DPO (`dpo.py`)"), ("grpo", "GRPO (`grpo.py`), gold reward"),
             ("rlhf_ppo_kl0", "PPO with `--kl-coef 0`"), ("grpo_rm", "GRPO, `--reward-model-path models/reward_model`")]


def newest(root, exp_name):
    """{tag: [value, ...]} of the newest run named `exp_name` in `root`, or None."""
    runs = sorted(glob.glob(os.path.join(root, f"{exp_name}__*")), key=os.path.getmtime)
    return {tag: [v for _, v in points] for tag, points in scalars(runs[-1]).items()} if runs else None


def rlhf(root="runs"):
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
    for exp_name, label in RLHF_ROWS:
        logs = newest(root, exp_name)
        if logs is None:
            continue
        at = [(0, "SFT (`models/sft`)"), (-1, label)] if first else [(-1, label)]
        first = False
        for i, name in at:
            values = [logs[tag][i] if tag in logs else float("nan")
                      for tag in ("eval/gold_accuracy", "eval/gold_score", "eval/score", "eval/kl")]
            print(f"| {name} | {100 * values[0]:.1f}% | {values[1]:.3f} | {values[2]:.2f} | {values[3]:.2f} |")


# ------------------------------------------------------------------------- variants (grpo_variants.sh)
VARIANTS = ["grpo", "dapo_loss", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "clip_higher", "gspo",
            "cispo", "mask_truncated", "soft_overlong", "dynamic_sampling", "dapo", "trl_defaults", "dppo", "dppo_kl",
            "maxrl", "scale_batch", "sapo", "luspo", "vespo", "two_terms", "gdpo", "entropy_coef", "adaptive_entropy",
            "top_entropy", "clip_cov", "kl_cov", "harsh", "harsh_entropy_coef", "harsh_adaptive_entropy",
            "harsh_top_entropy", "harsh_clip_cov", "harsh_kl_cov",
            "ppo_rm", "vcppo_rm", "vapo_rm", "ppo_gold", "vcppo_gold", "vapo_gold"]  # grpo_variants.sh's


def interval(values, n_prompts):
    """(mean, half-width of the 95% interval): over seeds, or with one seed the binomial one over the prompts."""
    if len(values) == 1:
        return values[0], 1.96 * math.sqrt(values[0] * (1 - values[0]) / n_prompts)
    return mean(values), half_width(values)


def run_mean(logs, tag):
    return sum(v for _, v in logs[tag]) / len(logs[tag]) if tag in logs else float("nan")


def last(logs, tag):
    return logs[tag][-1][1] if tag in logs else float("nan")


def variants(task_dir, csv=None, figure=None):
    """The table (and for rlhf_ppo.py's variants critic_table's); with `figure`, plot_entropy's curves (rlhf_ppo.py's
    variants: plot_value's)."""
    times = collections.defaultdict(dict)
    for line in open(os.path.join(task_dir, "times.txt")):
        variant, seed, seconds = line.split()
        times[variant][seed] = seconds
    rows = collections.defaultdict(dict)  # variant -> seed -> (start accuracy, final accuracy, kl, iterations, pass@8,
    curves = collections.defaultdict(dict)  # entropy per token at the end); variant -> seed -> logs
    for run_dir in sorted(glob.glob(os.path.join(task_dir, "runs", "*"))):
        name = os.path.basename(run_dir).split("__")[0]
        variant, seed = name.rsplit("_s", 1)
        logs = scalars(run_dir)
        tag = "eval/gold_accuracy" if "eval/gold_accuracy" in logs else "eval/rewards/numeric_match"
        if tag not in logs or times[variant].get(seed, "failed") == "failed":
            continue
        kl = logs["eval/kl"][-1][1] if "eval/kl" in logs else float("nan")
        rows[variant][seed] = (logs[tag][0][1], logs[tag][-1][1], kl, logs[tag][-1][0], last(logs, "eval/pass@8"),
                               last(logs, "objective/entropy") / last(logs, "objective/completion_length"))
        curves[variant][seed] = logs
        if csv:
            with open(csv, "a") as f:
                f.write(",".join(str(x) for x in (
                    os.path.basename(os.path.normpath(task_dir)), variant, seed, round(logs[tag][0][1], 4),
                    round(logs[tag][-1][1], 4), round(kl, 3), times[variant][seed],
                    round(run_mean(logs, "objective/prompts_sampled"), 1),
                    round(run_mean(logs, "objective/zero_std_fraction_sampled"), 3),
                    round(run_mean(logs, "objective/zero_std_fraction"), 3), round(last(logs, "eval/pass@8"), 4),
                    round(rows[variant][seed][5], 4))) + "\n")
    print("| variant | seeds | accuracy (95% interval) | per seed | gain over SFT | KL to SFT | pass@8 | entropy | wall time |")
    print("|-|-|-|-|-|-|-|-|-|")
    for variant, by_seed in sorted(rows.items(), key=lambda item: VARIANTS.index(item[0])):
        seeds = sorted(by_seed)
        final = [by_seed[s][1] for s in seeds]
        middle, half = interval(final, 512)
        gain = sum(by_seed[s][1] - by_seed[s][0] for s in seeds) / len(seeds)
        kl = sum(by_seed[s][2] for s in seeds) / len(seeds)
        wall = sum(float(times[variant][s]) for s in seeds) / len(seeds)
        kl_text = "—" if math.isnan(kl) else f"{kl:.2f}"  # none: β = 0 loads no reference
        passes, entropy = (mean([by_seed[s][i] for s in seeds]) for i in (4, 5))
        pass_text = "—" if math.isnan(passes) else f"{100 * passes:.1f}%"
        print(f"| {variant} | {','.join(seeds)} | {100 * middle:.1f}% ± {100 * half:.1f} | "
              f"{', '.join(f'{100 * v:.1f}' for v in final)} | {100 * gain:+.1f} | {kl_text} | {pass_text} | "
              f"{entropy:.3f} | {wall:.0f} s |")
    starts = {s: r[0] for by_seed in rows.values() for s, r in by_seed.items()}
    print("\nSFT model (the evaluation before the first update), by seed: "
          + ", ".join(f"{s}: {100 * v:.1f}%" for s, v in sorted(starts.items())))
    if set(curves) & set(RLHF_VARIANTS):
        critic_table({v: c for v, c in curves.items() if v in RLHF_VARIANTS})
    if figure and set(curves) & set(RLHF_VARIANTS):
        plot_value({v: c for v, c in curves.items() if v in RLHF_VARIANTS}, figure)
    elif figure:
        plot_entropy({v: c for v, c in curves.items() if v in ["grpo", *ENTROPY_METHODS] or v.startswith("harsh")},
                     figure)


RLHF_VARIANTS = ["ppo_rm", "vcppo_rm", "vapo_rm", "ppo_gold", "vcppo_gold", "vapo_gold"]


def critic_table(curves):
    """rlhf_ppo.py's critic, the mean over seeds: explained variance and value loss over the first 10 iterations and
    the last 10, and the explained variance at the end of the value warm-up."""
    def window(logs, tag, part):
        values = [v for _, v in logs.get(tag, [])]
        return mean(values[:10] if part == "first" else values[-10:]) if values else float("nan")

    print("\n| variant | explained variance, iterations 1-10 | last 10 | value loss, 1-10 | last 10 | after the warm-up |")
    print("|-|-|-|-|-|-|")
    for variant in sorted(curves, key=VARIANTS.index):
        by_seed = list(curves[variant].values())
        cells = [mean([window(logs, tag, part) for logs in by_seed]) for tag, part in (
            ("val/explained_variance", "first"), ("val/explained_variance", "last"), ("losses/value_loss", "first"),
            ("losses/value_loss", "last"))]
        warm = mean([last(logs, "val/warmup_explained_variance") for logs in by_seed])
        print(f"| {variant} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.3f} | {cells[3]:.4f} | "
              + ("—" if math.isnan(warm) else f"{warm:.2f}") + " |")


def plot_value(curves, figure):
    """rlhf_ppo.py's PPO, VC-PPO and VAPO rows: the mean over seeds of the critic's explained variance and value
    loss at each iteration, and of the evaluation's accuracy; the reward model's rows solid, the gold reward's
    dashed, one color per recipe."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for variant in sorted(curves, key=VARIANTS.index):
        by_seed, (recipe, reward) = list(curves[variant].values()), variant.split("_")
        style = {"color": f"C{['ppo', 'vcppo', 'vapo'].index(recipe)}", "linestyle": "-" if reward == "rm" else "--",
                 "label": variant, "linewidth": 1}
        accuracy = "eval/gold_accuracy" if "eval/gold_accuracy" in by_seed[0] else "eval/rewards/numeric_match"
        for ax, tag, scale in zip(axes, ("val/explained_variance", "losses/value_loss", accuracy), (1, 1, 100)):
            values = [[scale * v for _, v in logs[tag]] for logs in by_seed]
            ax.plot([step for step, _ in by_seed[0][tag]], [mean(c) for c in zip(*values)], **style)
    axes[0].set(xlabel="iteration", ylabel="explained variance", title="the critic: explained variance", ylim=(-1, 1))
    axes[1].set(yscale="log", xlabel="iteration", ylabel="value loss", title="the critic: value loss")
    axes[2].set(xlabel="iteration", ylabel="accuracy, %", title="evaluation accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(figure)
    print(f"\nwrote {figure}")


ENTROPY_METHODS = ["none", "entropy_coef", "adaptive_entropy", "top_entropy", "clip_cov", "kl_cov"]


def plot_entropy(curves, figure):
    """The mean over seeds of the rollout's entropy per token, at the defaults and in the harsh setting, each entropy
    method a color; and the harsh setting's eval/pass@8."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for variant in sorted(curves, key=VARIANTS.index):
        harsh, by_seed = variant.startswith("harsh"), list(curves[variant].values())
        method = variant.removeprefix("harsh").removeprefix("_") or "none"
        method = "none" if method == "grpo" else method
        color = f"C{ENTROPY_METHODS.index(method)}"
        entropy = [[e / n for (_, e), (_, n) in zip(logs["objective/entropy"], logs["objective/completion_length"])]
                   for logs in by_seed]
        steps = [step for step, _ in by_seed[0]["objective/entropy"]]
        axes[int(harsh)].plot(steps, [mean(c) for c in zip(*entropy)], color=color, label=method, linewidth=1)
        if harsh:
            passes = [[100 * v for _, v in logs["eval/pass@8"]] for logs in by_seed]
            axes[2].plot([step for step, _ in by_seed[0]["eval/pass@8"]], [mean(c) for c in zip(*passes)],
                         color=color, label=method, linewidth=1)
    axes[0].set(yscale="log", xlabel="iteration", ylabel="entropy per token (nats)", title="the defaults: entropy")
    axes[1].set(yscale="log", xlabel="iteration", title="--lr 1e-3 --beta 0: entropy")
    axes[2].set(xlabel="iteration", ylabel="pass@8, %", title="--lr 1e-3 --beta 0: eval pass@8")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(figure)
    print(f"\nwrote {figure}")


# ------------------------------------------------------------------------- off_policy (off_policy.sh)
CORRECTIONS = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "opsm"]


def seed_mean(by_seed, tag):
    """The mean over seeds of each run's mean of `tag` over its iterations."""
    return mean([mean([v for _, v in logs[tag]]) for logs in by_seed.values()])


def off_policy(out_dir, figure=None):
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
    for (lag, correction), found in sorted(runs.items(), key=lambda x: (x[0][0], CORRECTIONS.index(x[0][1]))):
        seeds = sorted(found)
        by_seed = {s: found[s] for s in seeds}
        final = [by_seed[s]["eval/gold_accuracy"][-1][1] for s in seeds]
        weights = "—"
        if "rollout/is_weight_mean" in by_seed[seeds[0]]:
            weights = (f"{seed_mean(by_seed, 'rollout/is_weight_mean'):.3f} / "
                       f"{100 * seed_mean(by_seed, 'rollout/is_masked_fraction'):.2f}%")
        elif "policy/off_policy_masked_fraction" in by_seed[seeds[0]]:
            weights = f"{100 * seed_mean(by_seed, 'policy/off_policy_masked_fraction'):.1f}% of completions"
        kl = mean([by_seed[s]["eval/kl"][-1][1] for s in seeds]) if "eval/kl" in by_seed[seeds[0]] else float("nan")
        spread = f" ± {100 * half_width(final):.1f}" if len(final) > 1 else ""  # one seed: no interval
        print(f"| {lag} | {correction} | {len(seeds)} | {100 * mean(final):.1f}%{spread} | "
              f"{', '.join(f'{100 * v:.1f}' for v in final)} | {seed_mean(by_seed, 'rollout/kl_k3'):.2e} | "
              f"{seed_mean(by_seed, 'rollout/logprob_diff_mean'):.2e} | {weights} | {kl:.2f} |")
    if figure:
        plot_off_policy(runs, figure)


def plot_off_policy(runs, figure):
    plt = pyplot()
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
            line, = ax.plot(steps, [mean(column) for column in zip(*values)], label=correction)
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


# ------------------------------------------------------------------------- distill (distill.sh)
# row: (the models' directory, seed → name; its label; the completions one logged step samples)
DISTILL_ROWS = [("student_s{}", "student after SFT (sft.py --n-layer 1 --n-embd 64)", None),
                ("grpo_s{}", "grpo.py (defaults: 120 × 256 completions)", 256),
                ("sampled_token_s{}", "distill.py --sampled-token (480 × 64)", 64),
                ("beta1_s{}", "distill.py --beta 1 (reverse KL, 480 × 64)", 64),
                ("beta0.5_s{}", "distill.py --beta 0.5 (JSD, 480 × 64)", 64),
                ("self_answer_s{}", "distill.py --self-distill (the target in context, 480 × 64)", 64),
                ("self_success_s{}", "distill.py --self-distill --teacher-context success (480 × 64)", 64),
                ("teacher", "teacher (sft.py, then grpo.py, 3 layers, 128 wide)", None)]


def accuracy(path, seed):
    """(sampled, greedy) gold accuracy of the model at `path` on the built-in task's eval prompts of `seed`, with
    distill.py's own sampler and task."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, os.path.dirname(HERE))
    import distill

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = distill.task_rows(seed, "eval", 512, distill.distillation_row)
    prompts = [distill.encode_prompt(tokenizer, row["prompt"]) for row in rows]
    stop_ids = distill.stop_token_ids(tokenizer)
    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for greedy in (False, True):
            sequences, _, width, _, _ = distill.generate(model, prompts, tokenizer.pad_token_id, stop_ids, 12, 1.0,
                                                         greedy)
            completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
            out.append(sum(c == row["target"] for c, row in zip(completions, rows)) / len(rows))
    return out


def distill_table(out_dir, figure=None):
    import torch

    torch.set_num_threads(1)
    times = dict(line.split() for line in open(os.path.join(out_dir, "times.txt")))
    seeds = sorted(int(name[len("grpo_s"):]) for name in times if name.startswith("grpo_s"))
    print("| row | gold accuracy, sampled (95% interval) | per seed | greedy | per seed | wall time, s (per seed) |")
    print("|-|-|-|-|-|-|")
    for pattern, label, _ in DISTILL_ROWS:
        names = [pattern.format(seed) for seed in seeds]
        sampled, greedy = zip(*(accuracy(os.path.join(out_dir, name), seed) for name, seed in zip(names, seeds)))
        walls = [float(times[name]) for name in dict.fromkeys(names)]
        wall = "—" if "failed" in walls else f"{mean(walls):.0f} ({', '.join(f'{w:.0f}' for w in walls)})"
        if pattern == "teacher":
            wall = f"{float(times['teacher_sft']) + float(times['teacher']):.0f} (sft.py + grpo.py)"
        print(f"| {label} | {100 * mean(sampled):.1f}% ± {100 * half_width(sampled):.1f} | "
              f"{', '.join(f'{100 * v:.1f}' for v in sampled)} | {100 * mean(greedy):.1f}% ± "
              f"{100 * half_width(greedy):.1f} | {', '.join(f'{100 * v:.1f}' for v in greedy)} | {wall} |")
    if figure:
        plot_distill(out_dir, seeds, figure)


def plot_distill(out_dir, seeds, figure):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for pattern, label, per_step in DISTILL_ROWS:
        if per_step is None:
            continue
        runs = [glob.glob(os.path.join(out_dir, "runs", f"{pattern.format(seed)}__*")) for seed in seeds]
        curves = [scalars(run_dir)["eval/gold_accuracy"] for (run_dir,) in runs]
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


# ------------------------------------------------------------------------- kto (rlhf_pipeline.sh kto)
KTO_ROWS = [("kto", "kto.py, every half of the pairs (defaults)"), ("dpo", "dpo.py, the pairs (defaults)"),
            ("kto_1to4", "kto.py, 1:4 (`--undesirable-fraction 0.2 --undesirable-weight 3`)"),
            ("kto_1to4_w1", "kto.py, 1:4, λ_U = 1 (`--undesirable-fraction 0.2`)"),
            ("kto_beta0.1", "kto.py, TRL's β (`--beta 0.1`)")]


def kto_table(out_dir, figure=None):
    times = {tuple(line.split()[:2]): float(line.split()[2]) for line in open(os.path.join(out_dir, "times.txt"))}
    print("| row | gold accuracy (95% interval) | per seed | pair accuracy | KL to SFT | wall time, s |")
    print("|-|-|-|-|-|-|")
    curves = {}
    for name, label in KTO_ROWS:
        runs = sorted(glob.glob(os.path.join(out_dir, f"{name}__{name}_s*")))
        if not runs:
            continue
        logs = [scalars(run) for run in runs]
        curves[label] = [log["eval/gold_accuracy"] for log in logs]
        gold, pairs, kl = ([log[tag][-1][1] for log in logs] for tag in ("eval/gold_accuracy", "eval/accuracy", "eval/kl"))
        walls = [t for (n, _), t in times.items() if n == name]
        print(f"| {label} | {100 * mean(gold):.1f}% ± {100 * half_width(gold):.1f} | "
              f"{', '.join(f'{100 * v:.1f}' for v in gold)} | {100 * mean(pairs):.1f}% | {mean(kl):.2f} | "
              f"{mean(walls):.0f} |")
    print(f"SFT model (step 0): {100 * mean([c[0][1] for c in curves[KTO_ROWS[0][1]]]):.1f}%")
    if figure:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for label, runs in curves.items():
            x = [step for step, _ in runs[0]]
            values = [[100 * v for _, v in run] for run in runs]
            line, = ax.plot(x, [mean(c) for c in zip(*values)], label=label.split(" (")[0], marker=".")
            ax.fill_between(x, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)], color=line.get_color(),
                            alpha=0.15)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("gold accuracy (sampled), %")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(figure)
        print(f"\nwrote {figure}")


TABLES = {"ppo": ppo, "trust_region": trust_region, "rlhf": rlhf, "variants": variants, "off_policy": off_policy,
          "distill": distill_table, "kto": kto_table}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in TABLES:
        sys.exit(f"usage: python benchmarks/summarize.py {{{','.join(TABLES)}}} DIR [...] (the docstring says what each does)")
    table, rest = sys.argv[1], sys.argv[2:]
    if table == "ppo" and "--beta-figure" in rest:
        at = rest.index("--beta-figure")
        ppo(rest[0])
        beta_figure(rest[0], rest[at + 1])
    else:
        TABLES[table](*rest)
