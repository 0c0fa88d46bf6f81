"""Training-throughput candidates put into the LM scripts from outside, so that each can be measured on a GPU
before it is written into scale/ (each changes results a little, so a kept one becomes a flag). Call
`apply(names)` before the script runs; benchmarks/gpu_step.py and benchmarks/rollout_timer.py take the names
from CANDIDATES=a,b:

  fused_adamw  torch's fused AdamW kernel (TRL's default optimizer) instead of the foreach one;
  whole_head   head_logprobs keeps each chunk's logits for the backward pass instead of recomputing them (the
               chunked LM head's activation checkpointing off: more memory, less arithmetic; so is any
               --gradient-checkpointing, so leave that off);
  compile      each transformer block's forward compiled by torch.compile (dynamic shapes) where it computes
               gradients; no-gradient passes (a frozen reference, the rollout, evaluation, sampling) stay eager.
               The scripts' passes that compute gradients build no KV cache (use_cache=False), which would
               compile the blocks again.
"""
import os
import sys

import torch

NAMES = ("fused_adamw", "whole_head", "compile")


def from_environment():
    """The names in CANDIDATES, checked."""
    names = [name for name in os.environ.get("CANDIDATES", "").split(",") if name]
    unknown = set(names) - set(NAMES)
    if unknown:
        sys.exit(f"error: unknown CANDIDATES {sorted(unknown)}: choose from {', '.join(NAMES)}")
    return names


def apply(names):
    if "fused_adamw" in names:
        class FusedAdamW(torch.optim.AdamW):
            def __init__(self, params, **kwargs):
                super().__init__(params, fused=True, **kwargs)

        torch.optim.AdamW = FusedAdamW
    if "whole_head" in names:  # the scripts import checkpoint from here when they run
        from torch.utils import checkpoint as activation_checkpointing

        activation_checkpointing.checkpoint = lambda function, *args, use_reentrant=None, **kw: function(*args, **kw)
    if "compile" in names:
        from transformers.modeling_utils import PreTrainedModel

        real_post_init = PreTrainedModel.post_init

        def post_init(self):
            real_post_init(self)
            blocks = set(self._no_split_modules or [])
            for module in self.modules():
                if type(module).__name__ in blocks and not hasattr(module, "eager_forward"):
                    module.eager_forward = module.forward
                    compiled = torch.compile(module.forward, dynamic=True)
                    module.forward = (lambda *args, _compiled=compiled, _eager=module.eager_forward, **kwargs:
                                      (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs))

        PreTrainedModel.post_init = post_init
