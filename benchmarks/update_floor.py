"""What bounds rlhf_ppo.py's training loop on the CPU, as one JSON line:

    OMP_NUM_THREADS=1 python benchmarks/update_floor.py [ITERATIONS]

1. rlhf_ppo.py at its defaults (models/sft, models/reward_model), ITERATIONS iterations (6 unless given) and no
   evaluation, under torch.profiler: each op's share of the self CPU time, the matrix products (aten::mm, addmm,
   bmm) and attention (scaled_dot_product_*) summed. Only their arithmetic is irreducible at float32; the rest
   (GPT-2's tanh GELU, written as eight elementwise ops, layer norms, copies, AdamW) is what a faster update could
   cut without changing the algorithm. The profiler inflates small ops, so the shares are of the profiled run.
2. The actor's forward and backward over one micro-batch of the update's most common shape in that run (rows,
   tokens, response tokens), eager against torch.compile (inductor, dynamic shapes), alternating, 2 pairs of 30
   steps, after the compiled one's first call (its compile time with a cold cache, also reported) and 3 warm-up
   steps each.
3. One matrix product of the update's shape (its rows × tokens by the model's width into the MLP's 4× width), in
   GFLOPS: what the machine's float32 and bfloat16 matmuls reach on one thread.
4. bfloat16 (--bf16: torch.autocast over the float32 weights), which changes what is computed: the actor's forward
   and backward on the same micro-batch, float32 against autocast with scaled_dot_product_attention's flash
   kernel (torch's default on the CPU) and with its math kernel, alternating, 2 rounds of 30 steps; and attention
   alone (forward and backward, causal) in both dtypes under both kernels, at the update's shape and at a 0.5B
   model's over 512 tokens."""
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # a cold compile, not an earlier run's cache

import torch
import torch.nn.functional as F
import tyro
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    spec = importlib.util.spec_from_file_location("rlhf_ppo", "rlhf_ppo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shapes = collections.Counter()  # the update's micro-batches: (rows, tokens, response tokens)
    policy_logprobs = script.policy_logprobs

    def recorded(model, sequences, attention_mask, context_length, temperature):
        if torch.is_grad_enabled():
            shapes[(*sequences.shape, sequences.shape[1] - context_length)] += 1
        return policy_logprobs(model, sequences, attention_mask, context_length, temperature)
    script.policy_logprobs = recorded
    args = tyro.cli(script.Args, args=["--num-iterations", str(iterations), "--eval-size", "0", "--no-cuda",
                                       "--output-dir", "/tmp/update_floor_model"])
    with profile() as prof:
        script.main(args)
    ops = prof.key_averages()
    total = sum(op.self_cpu_time_total for op in ops)
    share = lambda keep: sum(op.self_cpu_time_total for op in ops if keep(op.key)) / total  # noqa: E731
    result = {
        "profiled_s": round(total / 1e6, 2),
        "matmul_share": round(share(lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm")), 3),
        "attention_share": round(share(lambda k: "scaled_dot_product" in k), 3),
        "top_ops": {op.key: round(op.self_cpu_time_total / total, 3)
                    for op in sorted(ops, key=lambda op: -op.self_cpu_time_total)[:12]},
    }

    (rows, tokens, response), _ = shapes.most_common(1)[0]
    model = script.load_model(args.sft_model_path, "lm", torch.float32)
    model.train()
    torch.manual_seed(0)
    x = torch.randint(3, model.config.vocab_size, (rows, tokens))
    mask = torch.ones_like(x)

    def step(m, bf16=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(input_ids=x, attention_mask=mask, logits_to_keep=response + 1).logits
        logits.float().log_softmax(-1).sum().backward()

    def milliseconds(fn, repeats=30):
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return round((time.perf_counter() - start) / repeats * 1e3, 2)

    compiled = torch.compile(model, dynamic=True)
    start = time.perf_counter()
    step(compiled)
    result.update(shape={"rows": rows, "tokens": tokens, "response_tokens": response},
                  compile_s=round(time.perf_counter() - start, 1), eager_ms=[], compiled_ms=[])
    for m, name in ((model, "eager_ms"), (compiled, "compiled_ms")) * 2:
        result[name].append(milliseconds(lambda: step(m)))

    width, heads = model.config.hidden_size, model.config.num_attention_heads
    for dtype in (torch.float32, torch.bfloat16):
        a, w = torch.randn(rows * tokens, width, dtype=dtype), torch.randn(4 * width, width, dtype=dtype)
        seconds = milliseconds(lambda: a @ w.T, repeats=1000) / 1e3
        result[f"matmul_gflops_{str(dtype)[6:]}"] = round(2 * rows * tokens * width * 4 * width / seconds / 1e9)

    # bfloat16: the whole pass under autocast, then attention alone, each under both kernels
    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    result["actor_ms"] = {"float32": [], "bf16_flash": [], "bf16_math": []}
    for _ in range(2):
        result["actor_ms"]["float32"].append(milliseconds(lambda: step(model)))
        for name, kernel in kernels.items():
            with sdpa_kernel(kernel):
                result["actor_ms"][f"bf16_{name}"].append(milliseconds(lambda: step(model, bf16=True)))
    # attention at the update's shape, and at a 0.5B model's (Qwen2.5-0.5B: 14 heads of 64) over 512 tokens
    attention_shapes = {"update": (rows, heads, tokens, width // heads), "rows_2_heads_14_tokens_512": (2, 14, 512, 64)}
    for label, shape in attention_shapes.items():
        result[f"attention_ms_{label}"] = {}
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
            for name, kernel in kernels.items():
                def attention():
                    with sdpa_kernel(kernel):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
                result[f"attention_ms_{label}"][f"{str(dtype)[6:]}_{name}"] = milliseconds(attention, repeats=20)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
