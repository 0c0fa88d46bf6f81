"""The pairs of docs/scaling.md's speed tables (gpu_rollout.sh, gpu_supervised.sh run it). Two commands that each
print a JSON line with completions_per_s (benchmarks/rollout_timer.py, benchmarks/trl_grpo.py) or samples_per_second
(benchmarks/gpu_step.py, benchmarks/trl_supervised.py), run side by side:

    python benchmarks/rollout_speed.py PAIRS 'A=COMMAND' 'B=COMMAND'

They run PAIRS times each, alternating (A B, B A, A B, ...), one at a time, with the environment they inherit (run
under OMP_NUM_THREADS=1 for equal threads). Prints a markdown table: each pair's speeds, the ratio B / A,
its median and range, the same of the steady speed after a warmup where both sides report it
(benchmarks/step_clock.py), and the mean seconds of each part where the commands were given --profile. Run it alone
on an idle machine. UNTIMED_FIRST=1 runs A once more before the pairs and leaves that run out, so that no timed run
comes right after an idle GPU: on one H100, TRL's SFTTrainer ran at 30.2 and 30.5 steady samples/s where it came
first in a call and at 43.8 right after another run (docs/scaling.md)."""
import json
import os
import shlex
import statistics
import subprocess
import sys


def run(command):
    proc = subprocess.run(shlex.split(command), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"error: `{command}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def speed_of(result):
    """completions/s of a rollout loop, or samples/s of a supervised one (the scripts' charts/samples_per_second)."""
    for key in ("completions_per_s", "samples_per_second", "charts/samples_per_second"):
        if key in result:
            return result[key]
    sys.exit(f"error: no speed in {result}")


def main(pairs, *specs):
    (name_a, command_a), (name_b, command_b) = (spec.split("=", 1) for spec in specs)
    results = {name_a: [], name_b: []}
    if os.environ.get("UNTIMED_FIRST") == "1":
        print(f"untimed: {name_a} {json.dumps(run(command_a))}", file=sys.stderr)
    for pair in range(int(pairs)):
        order = ((name_a, command_a), (name_b, command_b))
        for name, command in order if pair % 2 == 0 else order[::-1]:
            results[name].append(run(command))
            print(f"pair {pair + 1}: {name} {json.dumps(results[name][-1])}", file=sys.stderr)
    unit = "completions/s" if "completions_per_s" in results[name_a][0] else "samples/s"
    speed = {name: [speed_of(r) for r in rs] for name, rs in results.items()}
    ratios = [b / a for a, b in zip(speed[name_a], speed[name_b])]
    print(f"| {name_a} ({unit}) | {name_b} ({unit}) | {name_b} / {name_a} per pair | median | range |\n"
          "|-|-|-|-|-|")
    print(f"| {', '.join(f'{s:.1f}' for s in speed[name_a])} | {', '.join(f'{s:.1f}' for s in speed[name_b])} | "
          f"{', '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}×** | "
          f"{min(ratios):.2f}–{max(ratios):.2f} |")
    if all("steady_samples_per_second" in r for rs in results.values() for r in rs):
        steady = {name: [r["steady_samples_per_second"] for r in rs] for name, rs in results.items()}
        warmup = results[name_a][0]["warmup_steps"]
        print(f"\nsteady samples/s, after the first {warmup} steps (benchmarks/step_clock.py)\n\n"
              f"| {name_a} | {name_b} | {name_b} / {name_a} per pair | median | range |\n|-|-|-|-|-|")
        ratios = [b / a for a, b in zip(steady[name_a], steady[name_b])]
        print(f"| {', '.join(f'{s:.1f}' for s in steady[name_a])} | {', '.join(f'{s:.1f}' for s in steady[name_b])} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}×** | "
              f"{min(ratios):.2f}–{max(ratios):.2f} |")
    if all("generation_tokens_per_s" in r for rs in results.values() for r in rs):
        tokens = {name: [r["generation_tokens_per_s"] for r in rs] for name, rs in results.items()}
        print(f"\ngeneration tokens/s (each completion up to its stop token, over the generation's seconds)\n\n"
              f"| {name_a} | {name_b} | {name_b} / {name_a} per pair | median |\n|-|-|-|-|")
        ratios = [b / a for a, b in zip(tokens[name_a], tokens[name_b])]
        print(f"| {', '.join(f'{s:,.0f}' for s in tokens[name_a])} | {', '.join(f'{s:,.0f}' for s in tokens[name_b])} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}×** |")
    if all("parts" in r for rs in results.values() for r in rs):
        parts = sorted({p for rs in results.values() for r in rs for p in r["parts"]})
        print(f"\nmean seconds of the loop per part\n\n| part | {name_a} | {name_b} |\n|-|-|-|")
        for part in parts + ["loop"]:
            cells = [statistics.mean(r["seconds"] if part == "loop" else r["parts"].get(part, 0.0) for r in results[n])
                     for n in (name_a, name_b)]
            print(f"| {part} | {cells[0]:.2f} | {cells[1]:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
