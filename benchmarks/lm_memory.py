"""Peak memory of the LM scripts' vocabulary-sized passes at a real vocabulary, before and after a change.

Runs the scripts' own functions (imported from SCRIPTS_DIR: this checkout, or an older one) on a random Llama
whose trunk is small (2 layers) and whose vocabulary and length are real (128,256 tokens, 1,024 positions), so
that the logits are what the peak measures:
  - sft_train:  one micro-batch of sft.py's training (forward, sft_loss, backward), --micro sequences
  - sft_eval:   sft.py's evaluation loss pass at the batch size the script uses by default (--eval-batch)
  - ppo_update: rlhf_ppo.py's policy_logprobs forward and backward, --micro sequences of 512 + 512 tokens
under bf16 autocast, as the scripts' --bf16 without --fsdp. CUDA: torch.cuda.max_memory_allocated; an
out-of-memory is reported as such.

    python benchmarks/lm_memory.py --scripts-dir . --eval-batch 4          # this checkout (eval: micro-batches)
    python benchmarks/lm_memory.py --scripts-dir /tmp/base --eval-batch 128  # before (eval: --eval-batch-size 128)
"""
import argparse
import importlib.util
import json
import os

import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scripts-dir", default=".")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--eval-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    sft = load(os.path.join(args.scripts_dir, "sft.py"), "sft_under_test")
    ppo = load(os.path.join(args.scripts_dir, "rlhf_ppo.py"), "ppo_under_test")
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.length)
    model = LlamaForCausalLM(config).to(device)
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731

    def measure(name, fn):
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            result = {"peak_gib": round(peak / 2**30, 2), "above_weights_gib": round((peak - base) / 2**30, 2)}
        except torch.OutOfMemoryError:
            result = {"peak_gib": "out of memory"}
        model.zero_grad(set_to_none=True)
        print(json.dumps({"pass": name, **result}), flush=True)

    def ids(batch, length):
        return torch.randint(0, args.vocab, (batch, length), device=device)

    def sft_loss(input_ids, labels, num_items=None):
        """sft.py's loss as its version computes it: from the LM head in chunks (head_logprobs, since it exists),
        or from the whole logits before."""
        if hasattr(sft, "head_logprobs"):
            logprobs = sft.head_logprobs(model, sft.next_tokens(labels), input_ids=input_ids)
            return sft.sft_loss(logprobs, labels, num_items)
        return sft.sft_loss(model(input_ids=input_ids).logits, labels, num_items)

    def sft_train():
        input_ids = ids(args.micro, args.length)
        labels = input_ids.clone()
        labels[:, : args.length // 2] = -100  # the prompt half carries no loss
        with amp():
            loss = sft_loss(input_ids, labels)
        loss.backward()

    @torch.no_grad()
    def sft_eval():
        input_ids = ids(args.eval_batch, args.length)
        with amp():
            sft_loss(input_ids, input_ids, num_items=1).item()

    def ppo_update():
        sequences = ids(args.micro, args.length)
        attention_mask = torch.ones_like(sequences)
        with amp():
            logprobs, _ = ppo.policy_logprobs(model, sequences, attention_mask, args.length // 2, 0.7)
        logprobs.sum().backward()

    print(json.dumps({"gpu": torch.cuda.get_device_name(), "scripts": os.path.abspath(args.scripts_dir),
                      "parameters": sum(p.numel() for p in model.parameters()), **vars(args)}), flush=True)
    for name, fn in (("sft_train", sft_train), ("sft_eval", sft_eval), ("ppo_update", ppo_update)):
        measure(name, fn)


if __name__ == "__main__":
    main()
