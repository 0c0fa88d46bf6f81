"""Run one LM script as `python SCRIPT ARGS` (or under torchrun) and report its wall time and the peak
CUDA memory it allocated, with the throughput the script logged (the last value of each `charts/*_per_second`
tag, measured over the training loop, loading excluded) and grpo's mean completion length, as one JSON line on
rank 0:

    python benchmarks/gpu_step.py sft.py --model-name-or-path m --bf16 ...
    torchrun --nproc-per-node 1 benchmarks/gpu_step.py rlhf_ppo.py ... --fsdp --bf16

`benchmarks/gpu_steps.sh` runs every LM script so on a random model of about 0.5B parameters.
"""
import glob
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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = max(glob.glob("runs/*"), key=os.path.getmtime)  # the run this call made
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    logged = {tag: round(acc.Scalars(tag)[-1].value, 2) for tag in acc.Tags()["scalars"]
              if tag.endswith("_per_second") or tag == "objective/completion_length"}
    print(json.dumps({"script": script, "args": " ".join(sys.argv[1:]), "seconds": round(time.time() - start, 1),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if torch.cuda.is_available() else None, **logged}), flush=True)
