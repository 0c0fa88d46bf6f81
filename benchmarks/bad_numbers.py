"""Every integer flag of an LM script at 0 and at −1 (with --floats: every real-valued flag at 0, −1, nan and inf),
each a short run in this process: does the run stop with one line (`error: ...`), crash with a traceback, or
complete? The evidence for the counts and ranges that check_args refuses.

    python benchmarks/bad_numbers.py sft scale/grpo ...        # scripts of this tree (all ten by default)
    python benchmarks/bad_numbers.py --floats sft ...          # the real-valued flags
    ROOT=/tmp/before python benchmarks/bad_numbers.py sft      # the scripts of another checkout (git worktree add)

A tiny SFT model and a reward model are made first, in WORK (/tmp/bad_numbers by default), for the scripts that
start from one. Prints one line per run and a count of each outcome.
"""
import ast
import importlib
import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.environ.get("ROOT", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORK = os.path.abspath(os.environ.get("WORK", "/tmp/bad_numbers"))
LM = ["sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]
# a short run of each script, on the CPU; the flag tried replaces its value here
SHORT = {"sft": ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--max-steps", "2", "--eval-every", "2",
                 "--num-train-examples", "64", "--eval-size", "4", "--batch-size", "8"],
         "reward_model": ["--max-steps", "2", "--eval-every", "2", "--num-train-pairs", "64", "--eval-size", "4",
                          "--batch-size", "8"],
         "dpo": ["--max-steps", "2", "--eval-every", "2", "--num-train-pairs", "64", "--eval-size", "4", "--batch-size", "8"],
         "rlhf_ppo": ["--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "4", "--eval-size", "4"],
         "grpo": ["--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "4", "--num-generations", "4",
                  "--eval-size", "4"]}


def numeric_flags(path, kinds):
    """The Args fields annotated as one of `kinds` ("int"; "float", "float | None"), in their order."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [node.target.id for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "Args"
            for node in cls.body if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) in kinds]


def outcome(module, argv):
    """'one line', 'TRACEBACK <type>' or 'completed' for one run of main."""
    import tyro

    for directory in ("out", "runs"):
        shutil.rmtree(directory, ignore_errors=True)
    try:
        module.main(tyro.cli(module.Args, args=argv))
    except SystemExit as e:
        return "one line" if str(e.code).startswith("error: ") and "\n" not in str(e.code) else f"exit {e.code!r}"
    except Exception as e:  # noqa: BLE001  what the user would see as a traceback
        return f"TRACEBACK {type(e).__name__}"
    return "completed"


def main():
    import torch

    torch.set_num_threads(1)
    floats = "--floats" in sys.argv
    scripts = [arg for arg in sys.argv[1:] if arg != "--floats"] or LM + [f"scale/{s}" for s in LM]
    kinds, values = (("float", "float | None"), ("0", "-1", "nan", "inf")) if floats else (("int",), ("0", "-1"))
    sys.path.insert(0, ROOT)
    os.makedirs(WORK, exist_ok=True)
    os.chdir(WORK)
    if not os.path.isdir("models/reward_model"):
        for script, flags in (("sft", SHORT["sft"][:6] + ["--max-steps", "5", "--num-train-examples", "200"]),
                              ("reward_model", ["--max-steps", "3", "--num-train-pairs", "100"])):
            subprocess.run([sys.executable, os.path.join(ROOT, f"{script}.py"), "--no-cuda", *flags, "--eval-size", "8"],
                           check=True, capture_output=True)
    tally = {}
    for script in scripts:
        name = os.path.basename(script)
        module = importlib.import_module(script.replace("/", "."))
        for field in numeric_flags(os.path.join(ROOT, f"{script}.py"), kinds):
            flag = "--" + field.replace("_", "-")
            short = SHORT[name]
            if flag in short:
                i = short.index(flag)
                short = short[:i] + short[i + 2 :]
            for value in values:
                result = outcome(module, ["--no-cuda", *short, flag, value, "--output-dir", "out"])
                kind = "traceback" if result.startswith("TRACEBACK") else result
                tally[kind] = tally.get(kind, 0) + 1
                print(f"{script} {flag} {value}: {result}", flush=True)
    print(", ".join(f"{kind}: {n}" for kind, n in sorted(tally.items())))


if __name__ == "__main__":
    main()
