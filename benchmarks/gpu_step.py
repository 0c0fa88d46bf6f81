"""Run one LM script as `python SCRIPT ARGS` (or under torchrun) and report its wall time and the peak
CUDA memory it allocated, with the throughput the script logged (the last value of each `charts/*_per_second`
tag, measured over the training loop, loading excluded) and grpo's mean completion length, as one JSON line on
rank 0:

    python benchmarks/gpu_step.py sft.py --model-name-or-path m --bf16 ...
    torchrun --nproc-per-node 1 benchmarks/gpu_step.py rlhf_ppo.py ... --fsdp --bf16

`benchmarks/gpu_steps.sh` runs every LM script so on a random model of about 0.5B parameters.

For the supervised scripts (sft, reward_model, dpo: one optimizer step per --batch-size samples) it also reports
the steady speed, samples/s after the first WARMUP_STEPS optimizer steps (default 10), timed as
benchmarks/trl_supervised.py times TRL's trainers (benchmarks/step_clock.py); PROFILE_STEPS=N profiles N steps
after the warmup instead (a run of its own).

CANDIDATES=a,b runs the script with training-throughput candidates put in from outside, so that one can be
measured before it is written into the scripts (each changes results a little):
  fused_adamw  torch's fused AdamW kernel (TRL's default optimizer) instead of the foreach one;
  whole_head   head_logprobs keeps each chunk's logits for the backward pass instead of recomputing them (the
               chunked LM head's activation checkpointing off: more memory, less arithmetic);
  no_cache     the models' config.use_cache off, so that a forward pass that is not sampling (training, scoring)
               builds no KV cache (transformers builds one by default and copies every layer's keys and values
               into it); sampling asks for its cache itself;
  compile      each transformer block's forward compiled by torch.compile (dynamic shapes) where it computes
               gradients; no-gradient passes (a frozen reference, evaluation, sampling) stay eager. With a KV cache
               in the training pass, the blocks compile again for it: take it with no_cache.
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
CANDIDATES = [c for c in os.environ.get("CANDIDATES", "").split(",") if c]
unknown = set(CANDIDATES) - {"fused_adamw", "whole_head", "no_cache", "compile"}
if unknown:
    sys.exit(f"error: unknown CANDIDATES {sorted(unknown)}: choose from fused_adamw, whole_head, no_cache, compile")
if "fused_adamw" in CANDIDATES:
    class FusedAdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            super().__init__(params, fused=True, **kwargs)

    torch.optim.AdamW = FusedAdamW
if "whole_head" in CANDIDATES:  # the scripts import checkpoint from here when they run
    import torch.utils.checkpoint

    torch.utils.checkpoint.checkpoint = lambda function, *args, use_reentrant=None, **kwargs: function(*args, **kwargs)
if "no_cache" in CANDIDATES or "compile" in CANDIDATES:
    from transformers.modeling_utils import PreTrainedModel

    real_post_init = PreTrainedModel.post_init

    def post_init(self):
        real_post_init(self)
        if "no_cache" in CANDIDATES:  # sampling passes use_cache=True itself
            self.config.use_cache = False
        if "compile" not in CANDIDATES:
            return
        blocks = set(self._no_split_modules or [])
        for module in self.modules():
            if type(module).__name__ in blocks and not hasattr(module, "eager_forward"):
                module.eager_forward, compiled = module.forward, torch.compile(module.forward, dynamic=True)
                module.forward = (lambda *args, _compiled=compiled, _eager=module.forward, **kwargs:
                                  (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs))

    PreTrainedModel.post_init = post_init
supervised = os.path.basename(script) in ("sft.py", "reward_model.py", "dpo.py") and "--batch-size" in sys.argv
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
    print(json.dumps({"script": script, "args": " ".join(sys.argv[1:]), "candidates": CANDIDATES,
                      "seconds": round(time.time() - start, 1),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if torch.cuda.is_available() else None, **logged, **steady}), flush=True)
