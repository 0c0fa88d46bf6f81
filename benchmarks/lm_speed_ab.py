"""Wall time of the LM scripts of two checkouts, side by side: python benchmarks/lm_speed_ab.py OLD_DIR NEW_DIR.

Each script runs from each checkout in turn, `--repeats` times, in a scratch directory whose models/ links to
the new checkout's models/ (run sft.py and reward_model.py there first). Run it alone on an idle machine."""
import os
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "sft.py": ["--max-steps", "300", "--eval-every", "1000", "--eval-size", "64"],
    "reward_model.py": ["--max-steps", "150", "--eval-every", "1000", "--eval-size", "64"],
    "dpo.py": ["--max-steps", "60", "--eval-every", "1000", "--eval-size", "64", "--num-train-pairs", "4000"],
    "rlhf_ppo.py": ["--num-iterations", "10", "--eval-every", "1000", "--eval-size", "64"],
}


def main(old, new, repeats=2):
    scratch = tempfile.mkdtemp()
    os.symlink(os.path.join(os.path.abspath(new), "models"), os.path.join(scratch, "models"))
    times = {}
    for script, flags in COMMANDS.items():
        for _ in range(repeats):
            for name, root in (("old", old), ("new", new)):
                start = time.time()
                subprocess.run([sys.executable, os.path.join(os.path.abspath(root), script), *flags,
                                "--output-dir", os.path.join(scratch, "out")], cwd=scratch, check=True,
                               capture_output=True)
                times.setdefault((script, name), []).append(time.time() - start)
    print("| script | old (s) | new (s) | new / old |\n|-|-|-|-|")
    for script in COMMANDS:
        a, b = min(times[(script, "old")]), min(times[(script, "new")])
        print(f"| `{script} {' '.join(COMMANDS[script])}` | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
