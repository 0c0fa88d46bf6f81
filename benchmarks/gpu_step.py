"""Our side of docs/scaling.md's table of the supervised scripts against TRL's trainers (benchmarks/gpu_supervised.sh
runs it). Runs one LM script as `python SCRIPT ARGS` (or under torchrun) and reports its wall time and the peak
CUDA memory it allocated, with the throughput the script logged (the last value of each `charts/*_per_second`
tag, measured over the training loop, loading excluded) and grpo's mean completion length, as one JSON line on
rank 0:

    python benchmarks/gpu_step.py sft.py --model-name-or-path m --bf16 ...
    torchrun --nproc-per-node 1 benchmarks/gpu_step.py rlhf_ppo.py ... --fsdp --bf16

For the supervised scripts (sft, reward_model, dpo: one optimizer step per --batch-size samples) it also reports
the steady speed, samples/s after the first WARMUP_STEPS optimizer steps (default 10), timed as
benchmarks/trl_supervised.py times TRL's trainers (benchmarks/step_clock.py); PROFILE_STEPS=N profiles N steps
after the warmup instead (a run of its own).
"""
import glob
import json
import os
import runpy
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_clock import StepClock  # noqa: E402

script, sys.argv = sys.argv[1], sys.argv[1:]
supervised = os.path.basename(script) in ("sft.py", "reward_model.py", "dpo.py", "kto.py") and "--batch-size" in sys.argv
warmup, profile_steps = int(os.environ.get("WARMUP_STEPS", "10")), int(os.environ.get("PROFILE_STEPS", "0"))
clock = StepClock(warmup, profile_steps) if supervised else None
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
    steady = clock.report(int(sys.argv[sys.argv.index("--batch-size") + 1])) if clock else {}
    print(json.dumps({"script": script, "args": " ".join(sys.argv[1:]),
                      "seconds": round(time.time() - start, 1),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if torch.cuda.is_available() else None, **logged, **steady}), flush=True)
