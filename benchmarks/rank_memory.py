"""Per-rank memory of sft.py, dpo.py and rlhf_ppo.py on 2 gloo ranks (the CPU), DDP vs --fsdp, on
a random Llama of about 100M parameters (10 layers, 640 wide, 32,000-token vocabulary, untied: 86M) saved in bf16
(dpo.py loads a reward model too, made from it; rlhf_ppo.py an actor, a reference, a reward model and a critic).

For each rank, four figures:
  - trained_state_mib: the bytes this rank holds of the trained models' parameters, gradients and AdamW state,
    counted tensor by tensor after the first optimizer step (under FSDP, the local shards);
  - after_load_mib: the process's resident memory (VmRSS) when the optimizer is built, after the models were
    loaded and placed;
  - load_peak_mib: the peak resident memory (VmHWM) up to then: imports, data, and loading and placing the models;
  - step_peak_mib: the peak resident memory (VmHWM, reset when the optimizer is built) up to the end of the first
    optimizer step: sft's evaluation at step 0 and the step; rlhf_ppo's rollout, scoring and first update.
On the CPU the "device" is the host, so RSS counts the Python process, the frozen models and every buffer;
the trained state is the figure FSDP divides by the world size.

    python benchmarks/rank_memory.py out.jsonl [ROOT]   # 6 torchrun runs of ROOT's scripts (default: this
                                                         # checkout), one JSON line per run and rank

Internally, each run is `torchrun --nproc-per-node 2 benchmarks/rank_memory.py --inner OUT SCRIPT ARGS`: the
script runs unchanged, with torch.optim.AdamW wrapped to take the readings.
"""
import json
import os
import runpy
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key + ":"))  # MiB


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def inner(out, script, argv):
    """Run `script` with AdamW wrapped: readings at its construction and after its first step."""
    readings = {}

    class Measured(torch.optim.AdamW):
        def __init__(self, params, *a, **k):
            params = list(params)
            super().__init__(params, *a, **k)
            readings["after_load_mib"] = status("VmRSS")
            readings["load_peak_mib"] = status("VmHWM")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM: the peak from here on is the step's
            self.first = True

        def step(self, *a, **k):
            result = super().step(*a, **k)
            if self.first:
                self.first = False
                readings["step_peak_mib"] = status("VmHWM")
                tensors = [p for g in self.param_groups for p in g["params"]]
                grads = [p.grad for p in tensors if p.grad is not None]
                states = [v for s in self.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
                readings["trained_state_mib"] = round(sum(map(local_bytes, tensors + grads + states)) / 2**20, 1)
                with open(f"{out}.rank{os.environ.get('RANK', '0')}", "w") as f:
                    json.dump(readings, f)
            return result

    torch.optim.AdamW = Measured
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def make_inputs(work):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from lm_models import make_tokenizer
    from test_real_models import write_data
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer("bos")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=640, intermediate_size=1728, num_hidden_layers=10,
                         num_attention_heads=10, num_key_value_heads=5, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # as hub checkpoints are
    print(f"random Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    model.save_pretrained(f"{work}/base")
    tokenizer.save_pretrained(f"{work}/base")
    from transformers import LlamaForSequenceClassification

    reward = LlamaForSequenceClassification.from_pretrained(f"{work}/base", num_labels=1, dtype=torch.bfloat16)
    reward.config.pad_token_id = tokenizer.eos_token_id
    reward.save_pretrained(f"{work}/reward")
    tokenizer.save_pretrained(f"{work}/reward")
    from pathlib import Path

    return (write_data(Path(work) / "sft.jsonl", "prompt_completion"), write_data(Path(work) / "pairs.jsonl", "explicit"),
            write_data(Path(work) / "prompts.jsonl", "text_prompts"))


def main(out, root):
    work = tempfile.mkdtemp()
    sft_data, pairs, prompts = make_inputs(work)
    commands = {
        "sft.py": ["--model-name-or-path", f"{work}/base", "--dataset-name", sft_data, "--max-steps", "1",
                   "--batch-size", "4", "--eval-size", "4", "--eval-every", "1"],
        "dpo.py": ["--model-name-or-path", f"{work}/base", "--reward-model-path", f"{work}/reward", "--dataset-name",
                   pairs, "--max-steps", "1", "--batch-size", "4", "--eval-size", "4", "--eval-every", "1",
                   "--response-length", "8"],
        "rlhf_ppo.py": ["--sft-model-path", f"{work}/base", "--reward-model-path", f"{work}/reward", "--dataset-name",
                        prompts, "--num-iterations", "1", "--batch-size", "4", "--mini-batch-size", "2",
                        "--response-length", "8", "--eval-size", "2"],
    }
    for script, flags in commands.items():
        for mode, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
            base = f"{work}/{script}.{mode}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), "--inner", base, os.path.join(root, script), *flags, *extra,
                   "--output-dir", f"{work}/out-{mode}", "--exp-name", mode]
            proc = subprocess.run(cmd, cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                sys.exit(f"{script} {mode} failed:\n{proc.stderr[-3000:]}")
            for rank in (0, 1):
                with open(f"{base}.rank{rank}") as f:
                    line = json.dumps({"script": script, "mode": mode, "rank": rank, **json.load(f)})
                print(line, flush=True)
                with open(out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--inner":
        inner(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "rank_memory.jsonl", os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else ROOT)
