"""Wall time of the LM scripts of two checkouts, side by side: python benchmarks/lm_speed_ab.py OLD_DIR NEW_DIR [PAIRS].

Each script runs from each checkout in turn, PAIRS times (default 3), the order alternating (old-new, new-old,
...), at the same thread count (torch's default, inherited by both), in a scratch directory whose models/ links to
the new checkout's models/ (run sft.py and reward_model.py there first). Prints every pair's new/old ratio, the
median and the range. Run it alone on an idle machine."""
import os
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "sft.py": ["--max-steps", "100", "--eval-every", "1000", "--eval-size", "64"],
    "reward_model.py": ["--max-steps", "60", "--eval-every", "1000", "--eval-size", "64"],
    "dpo.py": ["--max-steps", "20", "--eval-every", "1000", "--eval-size", "64", "--num-train-pairs", "1280"],
    "rlhf_ppo.py": ["--num-iterations", "3", "--eval-every", "1000", "--eval-size", "64"],
    "grpo.py": ["--num-iterations", "3", "--eval-every", "1000", "--eval-size", "64"],
}


def main(old, new, pairs=3):
    scratch = tempfile.mkdtemp()
    os.symlink(os.path.join(os.path.abspath(new), "models"), os.path.join(scratch, "models"))
    print("| command | old (s) per pair | new (s) per pair | new / old per pair | median | range |\n|-|-|-|-|-|-|", flush=True)
    for script, flags in COMMANDS.items():
        times = {"old": [], "new": []}
        for pair in range(pairs):
            for name in (("old", "new") if pair % 2 == 0 else ("new", "old")):
                start = time.time()
                subprocess.run([sys.executable, os.path.join(os.path.abspath(old if name == "old" else new), script),
                                *flags, "--output-dir", os.path.join(scratch, "out")], cwd=scratch, check=True,
                               capture_output=True)
                times[name].append(time.time() - start)
        ratios = sorted(b / a for a, b in zip(times["old"], times["new"]))
        print(f"| `{script} {' '.join(flags)}` | {', '.join(f'{t:.1f}' for t in times['old'])} | "
              f"{', '.join(f'{t:.1f}' for t in times['new'])} | "
              f"{', '.join(f'{b / a:.3f}' for a, b in zip(times['old'], times['new']))} | {ratios[len(ratios) // 2]:.3f} | "
              f"{ratios[0]:.3f}–{ratios[-1]:.3f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
