"""docs/scaling.md's sampling speed on one GPU: scale/grpo.py's `generate` with its two loops on a random Qwen2 of
Qwen2.5-0.5B's shape (benchmarks/random_qwen.py's model, built here in memory): ROWS rows (prompts of 164 tokens, each
repeated 8 times, as GRPO's groups) × 128 new tokens, under bf16 autocast over float32 weights as the scripts sample,
warm.

    python benchmarks/decode_speed.py [ROWS ...]      # default 256 64

For each row count, tokens/s of
- `loop`: sample_tokens, the eager loop (the CPU path): a cache that grows, finished rows leave, host syncs;
- `graphed`: sample_tokens_graphed, the CUDA path: a static cache and the step replayed as a CUDA graph;
- `graphed, bf16 weights`: the same with the weights themselves in bf16 (no autocast), for comparison.
Each is warmed up once, then the three are timed in turn, ROUNDS times (default 3, env ROUNDS): each round's
tokens/s, the median and the range, and graphed / loop per round. With ANCHOR=1 it also times transformers'
`generate` with `cache_implementation="static"` (its decode step compiled; bf16 weights, sampling), warmed up
once (the compile) and timed ROUNDS times after the rounds. Nothing stops early (a random model rarely draws its
stop token, so every row runs 128 steps). First it checks that the two loops agree in float32 (TF32 off): the
same greedy tokens for 32 rows × 48 tokens. Prints a markdown table."""
import os
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale import grpo  # noqa: E402


def seconds_of(fn, *args, **kwargs):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(row_counts):
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(device).eval()
    stops = torch.tensor([151643], device=device)

    def prompts(rows, width=164):
        distinct = torch.randint(0, 151000, (max(1, rows // 8), width), device=device)
        input_ids = distinct.repeat_interleave(8, 0)[:rows]
        return input_ids, torch.ones_like(input_ids)

    with torch.no_grad():  # the two loops agree: float32, greedy
        input_ids, mask = prompts(32)
        a, _ = grpo.sample_tokens(model, input_ids, mask, stops, 0, 48, 1.0, True)
        b, _ = grpo.sample_tokens_graphed(model, input_ids, mask, stops, 0, 48, 1.0, True)
        print(f"greedy tokens equal in float32 (32 rows x 48): {torch.equal(a, b)} "
              f"({(a != b).any(1).sum().item()} rows differ)", flush=True)
    rounds = int(os.environ.get("ROUNDS", 3))
    variants = (("loop", grpo.sample_tokens, False), ("graphed", grpo.sample_tokens_graphed, False),
                ("graphed, bf16 weights", grpo.sample_tokens_graphed, True))
    table = []
    for rows in row_counts:
        input_ids, mask = prompts(rows)
        speeds = {name: [] for name, _, _ in variants}
        for round_ in range(rounds + 1):  # round 0 warms up (cuBLAS handles, the allocator's blocks)
            for name, loop, bf16_weights in variants:
                model.to(torch.bfloat16 if bf16_weights else torch.float32)
                with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=not bf16_weights):
                    seconds = seconds_of(loop, model, input_ids, mask, stops, 0, 128, 1.0, False)
                if round_:
                    speeds[name].append(rows * 128 / seconds)
                    print(f"{rows} rows, round {round_}, {name}: {rows * 128 / seconds:,.0f} tokens/s "
                          f"({seconds:.2f} s)", flush=True)
        if os.environ.get("ANCHOR") == "1":
            model.to(torch.bfloat16)
            speeds["generate, static cache, bf16 weights"] = []
            for round_ in range(rounds + 1):  # round 0 compiles
                seconds = seconds_of(model.generate, input_ids, attention_mask=mask, max_new_tokens=128,
                                     min_new_tokens=128, do_sample=True, top_k=0, top_p=1.0,
                                     cache_implementation="static", pad_token_id=0)
                print(f"{rows} rows, round {round_}, generate static: {rows * 128 / seconds:,.0f} tokens/s "
                      f"({seconds:.2f} s)", flush=True)
                if round_:
                    speeds["generate, static cache, bf16 weights"].append(rows * 128 / seconds)
        model.to(torch.float32)
        ratios = [graphed / plain for graphed, plain in zip(speeds["graphed"], speeds["loop"])]
        table.append((rows, speeds, ratios))
    print(f"\n## Sampling on {torch.cuda.get_device_name()}, torch {torch.__version__}, {rounds} rounds\n")
    print("| rows × new tokens | loop | tokens/s per round | median | range |\n|-|-|-|-|-|")
    for rows, speeds, ratios in table:
        for name, values in speeds.items():
            print(f"| {rows} × 128 | {name} | {', '.join(f'{v:,.0f}' for v in values)} | "
                  f"**{statistics.median(values):,.0f}** | {min(values):,.0f}–{max(values):,.0f} |")
        print(f"| {rows} × 128 | graphed / loop | {', '.join(f'{r:.2f}' for r in ratios)} | "
              f"**{statistics.median(ratios):.2f}×** | {min(ratios):.2f}–{max(ratios):.2f} |")

if __name__ == "__main__":
    main([int(r) for r in sys.argv[1:]] or [256, 64])
