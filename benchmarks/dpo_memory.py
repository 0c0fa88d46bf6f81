"""Peak memory (RSS) of dpo.py's reference precompute and evaluation on a model with a large vocabulary:
a tiny random Llama (2 layers, 32 wide) whose output layer has 32,768 rows, 5,632 preference pairs of
~30 tokens (512 held out), one training step, and the evaluation of `--eval-size` held-out pairs and
prompts (default 512; pass `--eval-size 8` to see the reference precompute alone). Compares two copies of dpo.py, e.g. before and after a change:

    python benchmarks/dpo_memory.py OLD/dpo.py dpo.py [--flags for the second ...]
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import make_model, make_tokenizer  # noqa: E402


def main(scripts_and_flags):
    work = tempfile.mkdtemp()
    tokenizer = make_tokenizer("eos_no_pad")
    model = make_model("llama", 32768)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(f"{work}/model")
    tokenizer.save_pretrained(f"{work}/model")
    rows = [{"prompt": f"Question: sort the digits {' '.join(str((i * 7 + k) % 10) for k in range(6))} Answer:",
             "chosen": " 0 1 2 3 4 5", "rejected": " 5 4 3 2 1 0"} for i in range(5632)]
    with open(f"{work}/pairs.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    for script, *flags in scripts_and_flags:
        cmd = ["/usr/bin/time", "-f", "peak-kib %M", sys.executable, os.path.abspath(script), "--model-name-or-path", f"{work}/model",
               "--dataset-name", f"{work}/pairs.jsonl", "--reward-model-path", "None", "--max-steps", "1",
               "--batch-size", "8", "--warmup-steps", "1", "--output-dir", f"{work}/out", *flags]
        proc = subprocess.run(cmd, cwd=work, check=True, capture_output=True, text=True)
        peak = int(proc.stderr.strip().splitlines()[-1].split()[-1])
        print(f"{script} {' '.join(flags)}: peak RSS {peak / 1024:,.0f} MiB")


if __name__ == "__main__":
    args, groups = sys.argv[1:], []
    for a in args:
        if a.endswith(".py"):
            groups.append([a])
        else:
            groups[-1].append(a)
    main(groups)
