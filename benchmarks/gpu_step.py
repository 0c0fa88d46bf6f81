"""Run one LM script as `python SCRIPT ARGS` (or under torchrun) and report its wall time and the peak
CUDA memory it allocated, as one JSON line on rank 0:

    python benchmarks/gpu_step.py sft.py --model-name-or-path m --bf16 ...
    torchrun --nproc-per-node 1 benchmarks/gpu_step.py rlhf_ppo.py ... --fsdp --bf16

`benchmarks/gpu_steps.sh` runs every LM script so on a random model of about 0.5B parameters.
"""
import json
import os
import runpy
import sys
import time

import torch

script, sys.argv = sys.argv[1], sys.argv[1:]
start = time.time()
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    if e.code not in (None, 0):
        raise
if os.environ.get("RANK", "0") == "0":
    print(json.dumps({"script": script, "args": " ".join(sys.argv[1:]), "seconds": round(time.time() - start, 1),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if torch.cuda.is_available() else None}), flush=True)
