"""TRL's SFTTrainer, RewardTrainer or DPOTrainer with the settings of scale/sft.py, scale/reward_model.py or
scale/dpo.py, for benchmarks/gpu_supervised.sh. It runs in TRL's own environment (docs/scaling.md says how
to make one; on a lent GPU, TRL and its needs carried as wheels), never in this repo's:

    TRL_PYTHON benchmarks/trl_supervised.py sft|reward_model|dpo --model M --dataset D.jsonl [--gpu] \
        [--batch-size 8 --max-length 1024 --max-steps 40]

D is benchmarks/random_qwen.py's sft.jsonl (prompt, completion) or pref.jsonl (prompt, chosen, rejected). Settings
matched to the scripts' (their flags in gpu_supervised.sh): the batch in one micro-batch, no gradient checkpointing,
no packing and no padding-free batches (the scripts pad each batch to its longest row), the loss on the completion
only (SFT), AdamW with the scripts' weight decay (SFT 0.01, the reward model and DPO 0), gradient norm clipped to 1,
--lr with --warmup-steps of warmup then cosine decay (SFT) or linear decay (reward model, DPO), DPO's sigmoid loss
with β = 0.5 against a frozen copy of the starting model, dropout off for the reward model and DPO (SFT keeps the
checkpoint's, as scale/sft.py does; random_qwen.py's has none), float32 (--gpu: bfloat16 autocast over float32
weights, as the scripts' --bf16). TRL keeps its own defaults elsewhere: the fused AdamW kernel (the scripts' too,
on CUDA) and its own data order. Prints one JSON line: samples (pairs, for the reward model and
DPO) per second of the training loop, from the first step's start to the last step's end (the device waited for at
each step's end), as the scripts' charts/samples_per_second, and on CUDA the peak torch.cuda.max_memory_allocated;
also the steady speed after the first WARMUP_STEPS optimizer steps (default 10), or with PROFILE_STEPS=N a profile
of N steps after them, as benchmarks/gpu_step.py reports them for the scripts (benchmarks/step_clock.py)."""
import argparse
import json
import os
import sys
import tempfile
import time

import datasets
import torch
import transformers
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_clock import StepClock  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", choices=["sft", "reward_model", "dpo", "kto"])
    parser.add_argument("--model", required=True, help="a checkpoint directory (benchmarks/random_qwen.py's base)")
    parser.add_argument("--dataset", required=True, help="a .jsonl in TRL's format for the script")
    parser.add_argument("--batch-size", type=int, default=8, help="samples (pairs) per optimizer step")
    parser.add_argument("--max-length", type=int, default=1024, help="longest prompt + completion in tokens")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="CUDA, bfloat16 autocast over float32 weights")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows = [json.loads(line) for line in open(args.dataset)]
    common = dict(output_dir=tempfile.mkdtemp(), seed=args.seed, use_cpu=not args.gpu, report_to="none",
                  save_strategy="no", eval_strategy="no", logging_steps=10**9, dataloader_num_workers=0,
                  per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1, max_steps=args.max_steps,
                  learning_rate=args.lr, warmup_steps=args.warmup_steps, max_grad_norm=1.0,
                  gradient_checkpointing=False, bf16=args.gpu, max_length=args.max_length,
                  model_init_kwargs={"dtype": torch.float32})  # float32 master weights, as the scripts'
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if args.script == "sft":
        config = SFTConfig(**common, lr_scheduler_type="cosine", weight_decay=0.01, packing=False, padding_free=False,
                           completion_only_loss=True)
        trainer = SFTTrainer(model=args.model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    elif args.script == "reward_model":
        config = RewardConfig(**common, lr_scheduler_type="linear", weight_decay=0.0, disable_dropout=True,
                              center_rewards_coefficient=None)
        trainer = RewardTrainer(model=args.model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=tokenizer)
    elif args.script == "kto":  # the pairs unpaired, as kto.py does; batch-size completions
        config = KTOConfig(**common, lr_scheduler_type="linear", weight_decay=0.0, disable_dropout=True, beta=0.5)
        trainer = KTOTrainer(model=args.model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    else:
        config = DPOConfig(**common, lr_scheduler_type="linear", weight_decay=0.0, disable_dropout=True, beta=0.5,
                           loss_type=["sigmoid"], precompute_ref_log_probs=False)
        trainer = DPOTrainer(model=args.model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)

    class LoopTime(transformers.TrainerCallback):
        """The training loop's time: from the first step's start to the last step's end."""

        def on_step_begin(self, cfg, state, control, **kwargs):
            if state.global_step == 0:
                sync()
                self.start = time.perf_counter()

        def on_step_end(self, cfg, state, control, **kwargs):
            sync()
            self.end = time.perf_counter()

    loop = LoopTime()
    trainer.add_callback(loop)
    clock = StepClock(int(os.environ.get("WARMUP_STEPS", "10")), int(os.environ.get("PROFILE_STEPS", "0")))
    trainer.train()
    seconds = loop.end - loop.start
    print(json.dumps({"side": f"TRL {type(trainer).__name__}", "steps": args.max_steps, "seconds": seconds,
                      "samples_per_second": args.max_steps * args.batch_size / seconds,
                      "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.gpu else None,
                      **clock.report(args.batch_size)}))


if __name__ == "__main__":
    main()
