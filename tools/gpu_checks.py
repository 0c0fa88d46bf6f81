"""Issue 101's measurements on a lent GPU, prepared to run once: the sampler's decode step split into its parts, and
how far the sampler's log-probs and the trainer's are apart in bf16. On Qwen2.5-0.5B's shape with random weights
(benchmarks/decode_speed.py's model), bf16 autocast over float32 weights as the scripts sample.

    python tools/gpu_checks.py                  # on the GPU: ROWS 256 × NEW 128, as docs/scaling.md's figure
    python tools/gpu_checks.py --dry-run        # on the CPU, a tiny Qwen2, 16 × 16: that every part runs

1. decode: one step of `sample_tokens_graphed`'s loop, eager, timed part by part with CUDA events over STEPS steps
   (default 32) after the prompt: the transformer blocks with the static cache, the LM head, the draw (softmax and
   the exponential race), the drawn token's log-prob; then the whole graphed loop's tokens/s, its time per step, and
   the bound that memory bandwidth sets (BANDWIDTH bytes/s, default 4.8e12, an H200's): the weights read once a step
   (float32 read and cast to bf16 under autocast: 4 + 2 + 2 bytes a parameter; bf16 weights: 2) plus the KV cache.
2. mismatch: ROWS × NEW tokens sampled by `generate`, then scored by the trainer's `policy_logprobs` on the same
   sequences; the share of response tokens whose ratio π_trainer / π_sampler lies outside [0.9, 1.1], and the largest
   and mean abs(Δ log p). Twice: the head in bf16 (as the scripts run), and in float32 on both sides (ScaleRL's fix).

The run on a lent GPU, in one call (the suite after these, as much as its time allows; TIME_SUITE seconds):
    python tools/gpu_checks.py 2>&1 | tee $OUT/checks.log; ANCHOR=1 ROUNDS=2 python benchmarks/decode_speed.py 256 \
      2>&1 | tee $OUT/decode.log; timeout ${TIME_SUITE:-300} python -m pytest -n 16 tests -q -rfs 2>&1 | tee $OUT/suite.log
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale import grpo  # noqa: E402


class Float32Head(torch.nn.Linear):
    """The LM head in float32 under autocast: ScaleRL's fix for the sampler/trainer mismatch."""

    def forward(self, h):
        with torch.autocast(h.device.type, enabled=False):
            return F.linear(h.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def timer(device):
    """A function that returns seconds since its last call, the device synchronized."""
    last = [None]

    def lap():
        if device.type == "cuda":
            torch.cuda.synchronize()
        now, previous = time.perf_counter(), last[0]
        last[0] = now
        return 0.0 if previous is None else now - previous
    return lap


def decode_parts(model, input_ids, attention_mask, steps):
    """Median seconds per step of each part of the decode step, eager, with the graphed loop's static cache and masks."""
    rows, width = input_ids.shape
    device, length = input_ids.device, width + steps + 1
    cache = StaticCache(config=model.config, max_cache_len=length)
    keys = F.pad(attention_mask, (0, steps + 1)).bool()
    causal = torch.ones(width, length, dtype=torch.bool, device=device).tril()
    prompt_mask = (keys[:, None, :] & causal) | torch.eye(width, length, dtype=torch.bool, device=device)
    logits = model(input_ids=input_ids, attention_mask=prompt_mask[:, None], position_ids=grpo.position_ids_of(attention_mask),
                   use_cache=True, logits_to_keep=1, **{grpo.CACHE: cache}).logits[:, -1]
    position = attention_mask.sum(1, keepdim=True) - 1
    parts, lap = {"blocks": [], "head": [], "draw": [], "log-prob": []}, timer(device)
    lap()
    for t in range(steps):
        z = logits.float()
        tokens = (torch.softmax(z, -1) / torch.empty_like(z).exponential_()).argmax(-1)
        parts["draw"].append(lap())
        torch.log_softmax(z, -1).gather(1, tokens[:, None])
        parts["log-prob"].append(lap())
        keys[:, width + t] = True
        position += 1
        hidden = model.model(input_ids=tokens[:, None], attention_mask=keys[:, None, None, :], position_ids=position,
                             use_cache=True, **{grpo.CACHE: cache}).last_hidden_state
        parts["blocks"].append(lap())
        logits = model.lm_head(hidden[:, -1])
        parts["head"].append(lap())
    return {name: statistics.median(values[1:]) for name, values in parts.items()}


def mismatch(model, prompt_ids, new_tokens):
    """(share of response tokens with π_trainer / π_sampler outside [0.9, 1.1], max abs Δ log p, mean abs Δ log p)."""
    sequences, attention_mask, context, response_mask, sampler = grpo.generate(model, prompt_ids, 0, [151643], new_tokens)
    if isinstance(model.lm_head, Float32Head):  # the trainer's pass with the head in float32, on the response positions
        hidden = model.model(input_ids=sequences, attention_mask=attention_mask,
                             position_ids=grpo.position_ids_of(attention_mask)).last_hidden_state[:, context - 1:-1]
        trainer = torch.log_softmax(model.lm_head(hidden), -1).gather(-1, sequences[:, context:, None]).squeeze(-1)
    else:
        trainer, _ = grpo.policy_logprobs(model, sequences, attention_mask, context, 1.0)
    delta = (trainer.float() - sampler)[response_mask.bool()]
    return ((delta.exp() - 1).abs() > 0.1).float().mean().item(), delta.abs().max().item(), delta.abs().mean().item()


def main(dry_run):
    device = torch.device("cpu" if dry_run else "cuda")
    rows, new_tokens, steps = (16, 16, 8) if dry_run else (int(os.environ.get("ROWS", 256)), 128,
                                                          int(os.environ.get("STEPS", 32)))
    size = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2)
    if dry_run:
        size = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**size, max_position_embeddings=2048, tie_word_embeddings=True,
                                         attn_implementation="sdpa")).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    name = "the CPU (dry run)" if dry_run else torch.cuda.get_device_name()
    print(f"## {name}, torch {torch.__version__}; {params / 1e6:.0f}M parameters, {rows} rows x {new_tokens} new tokens")
    distinct = torch.randint(0, 151000, (max(1, rows // 8), 164), device=device)
    input_ids = distinct.repeat_interleave(8, 0)[:rows]
    mask = torch.ones_like(input_ids)
    amp = torch.autocast(device.type, torch.bfloat16)
    with torch.no_grad(), amp:
        decode_parts(model, input_ids, mask, 4)  # warm up
        parts = decode_parts(model, input_ids, mask, steps)
        lap = timer(device)
        lap()
        grpo.sample_tokens_graphed(model, input_ids, mask, torch.tensor([151643], device=device), 0, new_tokens, 1.0,
                                   False, graph=not dry_run)
        seconds = lap()
    print("\n| part of an eager decode step | ms (median) | share |\n|-|-|-|")
    for part, s in parts.items():
        print(f"| {part} | {1e3 * s:.3f} | {100 * s / sum(parts.values()):.0f}% |")
    print(f"| eager step, total | {1e3 * sum(parts.values()):.3f} | |")
    kv = rows * size["num_hidden_layers"] * 2 * size["num_key_value_heads"] * (size["hidden_size"] // size["num_attention_heads"]) * 2 * (164 + new_tokens / 2)
    bandwidth = float(os.environ.get("BANDWIDTH", 4.8e12))
    print(f"\ngraphed loop: {rows * new_tokens / seconds:,.0f} tokens/s, {1e3 * seconds / new_tokens:.3f} ms a step")
    for label, weight_bytes in (("float32 weights under autocast", 8), ("bf16 weights", 2)):
        bound = (weight_bytes * params + kv) / bandwidth
        print(f"bandwidth bound, {label}: {1e3 * bound:.3f} ms a step, {rows / bound:,.0f} tokens/s")
    prompt_ids = input_ids[:min(rows, 64)].tolist()
    print("\n| head | tokens with ratio outside [0.9, 1.1] | max abs Δ log p | mean abs Δ log p |\n|-|-|-|-|")
    for head in ("bf16", "float32"):
        if head == "float32":
            model.lm_head.__class__ = Float32Head
        torch.manual_seed(1)
        with torch.no_grad(), amp:
            outside, largest, average = mismatch(model, prompt_ids, new_tokens)
        print(f"| {head} | {100 * outside:.3f}% | {largest:.4f} | {average:.5f} |")


if __name__ == "__main__":
    main("--dry-run" in sys.argv)
