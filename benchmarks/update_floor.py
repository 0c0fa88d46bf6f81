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
   GFLOPS: what the machine's float32 matmul reaches on one thread."""
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # a cold compile, not an earlier run's cache

import torch
import tyro
from torch.profiler import profile


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    spec = importlib.util.spec_from_file_location("rlhf_ppo", "rlhf_ppo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shapes = collections.Counter()  # the update's micro-batches: (rows, tokens, response tokens)
    response_logprobs = script.response_logprobs

    def recorded(model, sequences, attention_mask, context_length, temperature):
        if torch.is_grad_enabled():
            shapes[(*sequences.shape, sequences.shape[1] - context_length)] += 1
        return response_logprobs(model, sequences, attention_mask, context_length, temperature)
    script.response_logprobs = recorded
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

    def step(m):
        logits = m(input_ids=x, attention_mask=mask, logits_to_keep=response + 1).logits
        logits.float().log_softmax(-1).sum().backward()

    compiled = torch.compile(model, dynamic=True)
    start = time.perf_counter()
    step(compiled)
    result.update(shape={"rows": rows, "tokens": tokens, "response_tokens": response},
                  compile_s=round(time.perf_counter() - start, 1), eager_ms=[], compiled_ms=[])
    for m, name in ((model, "eager_ms"), (compiled, "compiled_ms")) * 2:
        for _ in range(3):
            step(m)
        start = time.perf_counter()
        for _ in range(30):
            step(m)
        result[name].append(round((time.perf_counter() - start) / 30 * 1e3, 1))

    width = model.config.hidden_size
    a, w = torch.randn(rows * tokens, width), torch.randn(4 * width, width)
    start = time.perf_counter()
    for _ in range(1000):
        a @ w.T
    seconds = (time.perf_counter() - start) / 1000
    result["matmul_gflops"] = round(2 * rows * tokens * width * 4 * width / seconds / 1e9)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
