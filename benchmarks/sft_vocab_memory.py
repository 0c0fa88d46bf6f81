"""Peak resident memory of one sft.py step at a real vocabulary, float32 on the CPU: a random Qwen2 with a
151,936-token vocabulary (Qwen2.5's) and a small trunk (2 layers, 64 wide, untied head), a batch of 4 sequences
of 1,024 tokens, one optimizer step, no evaluation. The LM head's output alone is 4 × 1,024 × 151,936 float32
numbers = 2.3 GiB, and its gradient as much: that, not the trunk, is what the peak measures.

    python benchmarks/sft_vocab_memory.py ROOT [ROOT ...]   # sft.py of each checkout (e.g. /tmp/before and .)

Each run is `python ROOT/sft.py ...` in a subprocess of a fresh process; its peak is that child's maximum
resident set size (getrusage), one JSON line per run. Pass `--cap-gib N` to run it under an address-space limit of N GiB
(ulimit -v) and see whether it fits.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def make_inputs(work):
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import torch
    from lm_models import make_tokenizer
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer("pad_is_eos")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(f"{work}/model")
    tokenizer.save_pretrained(f"{work}/model")
    tokenizer = AutoTokenizer.from_pretrained(f"{work}/model")  # as sft.py will read it
    words = "sort the digits 8 1 9 and the cat sat on the mat, what is the answer? It is 42. ".split()
    rows = []
    for i in range(4):  # prompt + completion + EOS: up to 1,024 tokens, as sft.py tokenizes them
        text = " ".join(words[(i + j) % len(words)] for j in range(2000))
        ids, n = tokenizer(text)["input_ids"], 1023
        while True:
            prompt, completion = tokenizer.decode(ids[:100]), tokenizer.decode(ids[100:n])
            if len(tokenizer(prompt)["input_ids"]) + len(tokenizer(completion)["input_ids"]) + 1 <= 1024:
                break
            n -= 1
        rows.append({"prompt": prompt, "completion": completion})
    with open(f"{work}/data.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return f"{work}/model", f"{work}/data.jsonl"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+")
    parser.add_argument("--cap-gib", type=float, default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp()
    model, data = make_inputs(work)
    for root in args.roots:
        cmd = [sys.executable, os.path.join(os.path.abspath(root), "sft.py"), "--model-name-or-path", model,
               "--dataset-name", data, "--max-steps", "1", "--batch-size", "4", "--max-length", "1024", "--no-cuda",
               "--no-bf16", "--warmup-steps", "0", "--output-dir", f"{work}/out", "--exp-name", "vocab"]
        if args.cap_gib is not None:
            cmd = ["bash", "-c", f'ulimit -v {int(args.cap_gib * 2**20)} && exec "$@"', "sh", *cmd]
        # the peak of this run alone: a fresh process waits for it and reads its children's maximum resident set
        wrapper = ("import resource, subprocess, sys; run = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                   "print(run.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
                   "print((run.stdout + run.stderr).strip().splitlines()[-1][:300] if run.returncode else '')")
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], cwd=work, capture_output=True, text=True).stdout
        (code, peak_kib), last = (int(x) for x in out.splitlines()[0].split()), out.splitlines()[1:]
        print(json.dumps({"root": os.path.abspath(root), "returncode": code, "peak_rss_mib": round(peak_kib / 1024),
                          "cap_gib": args.cap_gib, "error": last[0] if last else ""}), flush=True)


if __name__ == "__main__":
    main()
