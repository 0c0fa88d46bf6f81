"""TRL 1.16's DistillationTrainer on distill.py's built-in task with distill.py's defaults, for docs/distill.md's
speed comparison (benchmarks/distill_speed.sh). It runs in TRL's own virtual environment (docs/scaling.md says how
to make it), never in this repo's:

    TRL_PYTHON benchmarks/trl_distill.py --model-name-or-path S --teacher-model-name-or-path T --num-iterations 100

The student, teacher, tokenizer and prompts are distill.py's (its task functions are imported from it). Settings
matched to distill.py's: one generation batch of 64 completions per optimizer step, 12 new tokens at temperature 1
(no top-k, no top-p), β = 1 (the reverse KL, TRL's default), the divergence at temperature 1, AdamW lr 1e-4 (weight
decay 0.01, torch's default) annealed linearly to 0, gradient norm clipped to 1, dropout off, float32 and no gradient
checkpointing (TRL's defaults turn on bf16 and checkpointing), no evaluation, nothing saved. Prints one JSON line:
the completions per second of the training loop (from the first step's start to the last step's end) and the mean
training loss. --position-ids passes the forward the positions distill.py passes (real tokens counted, padding not),
which TRL's leaves out (docs/distill.md: its loss on a GPT-2 with left-padded prompts)."""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets  # noqa: E402
import transformers  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402

import distill  # noqa: E402  the built-in task, exactly distill.py's


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name-or-path", default="models/sft_small")
    parser.add_argument("--teacher-model-name-or-path", default="models/grpo")
    parser.add_argument("--num-iterations", type=int, default=100, help="batches of --batch-size completions")
    parser.add_argument("--batch-size", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--position-ids", action="store_true", help="positions that count real tokens only")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
    rows = distill.task_rows(args.seed, "train", 50_000, distill.distillation_row)  # distill.py's training prompts
    # TRL tokenizes a text prompt with the tokenizer's special tokens, which for this ByT5 tokenizer end it with EOS;
    # distill.py's prompts have none (encode_prompt), and a prompt that ends in EOS is another task
    tokenizer.build_inputs_with_special_tokens = lambda ids, pair=None: ids + (pair or [])
    for row in rows[:100]:
        assert tokenizer(text=[row["prompt"]])["input_ids"][0] == distill.encode_prompt(tokenizer, row["prompt"])
    config = DistillationConfig(
        output_dir=tempfile.mkdtemp(), seed=args.seed, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1, max_completion_length=12,
        beta=1.0, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-4, lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, gradient_checkpointing=False, bf16=False,
        model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
        max_steps=args.num_iterations)
    trainer = DistillationTrainer(model=args.model_name_or_path, teacher_model=args.teacher_model_name_or_path,
                                  args=config, train_dataset=datasets.Dataset.from_list(rows),
                                  processing_class=tokenizer)

    class LoopTime(transformers.TrainerCallback):
        """The training loop's time: from the first step's start to the last step's end."""

        def on_step_begin(self, cfg, state, control, **kwargs):
            if state.global_step == 0:
                self.start = time.perf_counter()

        def on_step_end(self, cfg, state, control, **kwargs):
            self.end = time.perf_counter()

    if args.position_ids:  # each backbone gets distill.py's positions where TRL's forward passes none
        for model in (trainer.model, trainer.teacher_model):
            def forward(*a, real=model.base_model.forward, **k):
                if k.get("position_ids") is None:  # the loss's forward (generation passes its own)
                    k["position_ids"] = distill.position_ids_of(k["attention_mask"])
                return real(*a, **k)
            model.base_model.forward = forward
    loop = LoopTime()
    trainer.add_callback(loop)
    result = trainer.train()
    seconds = loop.end - loop.start
    completions = args.num_iterations * args.batch_size
    print(json.dumps({"side": "trl", "threads": torch.get_num_threads(), "completions": completions,
                      "seconds": seconds, "completions_per_s": completions / seconds,
                      "mean_loss": result.training_loss}))


if __name__ == "__main__":
    main()
