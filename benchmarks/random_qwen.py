"""A random Qwen2 of Qwen2.5-0.5B's shape (24 layers, 896 wide, 151,936-token vocabulary: 494M parameters, saved in
bf16) with a small tokenizer trained on the fly, and data of about 250 tokens per prompt and completion, for the GPU
benchmarks of docs/scaling.md (gpu_rollout.sh, gpu_supervised.sh, decode_speed.py); no download:

    python benchmarks/random_qwen.py DIR    # DIR/base, DIR/sft.jsonl, DIR/pref.jsonl, DIR/prompts.jsonl
    python benchmarks/random_qwen.py DIR --tiny    # 2 layers, 64 wide, the tokenizer's vocabulary: the same
                                                   # files, to try the GPU benchmarks' commands on a CPU (DATA=DIR)
"""
import json
import os
import random
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from lm_models import make_tokenizer  # noqa: E402

work, tiny = sys.argv[1], "--tiny" in sys.argv[2:]
tokenizer = make_tokenizer("pad_is_eos")  # a small trained tokenizer; the model's 151,936 rows as Qwen2.5's
torch.manual_seed(0)
shape = (dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4) if tiny else
         dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14))
model = Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, max_position_embeddings=2048,
                                     tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id))
model.to(torch.bfloat16).save_pretrained(f"{work}/base")
tokenizer.save_pretrained(f"{work}/base")
rng = random.Random(0)
words = "sort the digits cat sat on mat hello world what is the answer it is 42".split()
text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
with open(f"{work}/sft.jsonl", "w") as f, open(f"{work}/pref.jsonl", "w") as g, open(f"{work}/prompts.jsonl", "w") as h:
    for _ in range(256):
        p = text(120)
        f.write(json.dumps({"prompt": p, "completion": text(120)}) + "\n")
        g.write(json.dumps({"prompt": p, "chosen": text(120), "rejected": text(110)}) + "\n")
        h.write(json.dumps({"prompt": p, "target": "1 2 3"}) + "\n")
