"""TRL's GRPOTrainer on grpo.py's built-in task with grpo.py's defaults, for benchmarks/grpo_vs_trl.sh. It runs in
TRL's own virtual environment (docs/rollout_speed.md says how to make it), never in this repo's:

    TRL_PYTHON benchmarks/trl_grpo.py --sft-model-path models/sft --num-iterations 10 [--profile]

The model, tokenizer and prompts are those of grpo.py (its task functions are imported from it); the reward is the
gold score, or −1 for a completion with no stop token (grpo.py's --missing-eos-penalty). Settings matched to
grpo.py: G = 8, 256 completions per rollout (steps_per_generation 4 × 64), minibatches of 64, μ = 2
(num_iterations), 12 new tokens, β = 0.04, ε = 0.2, loss "grpo", rewards scaled by the group's std, AdamW lr 1e-4
(weight decay 0.01, torch's default) annealed linearly to 0, gradient norm clipped to 1, temperature 1, no top-k /
top-p, dropout off, float32 and no gradient checkpointing (TRL's defaults turn on bf16 and checkpointing). Prints one JSON line: the completions per second of the training loop (from the first step's
start to the last step's end, as grpo.py's charts/episodes_per_second) and, with --profile, the seconds spent in
each part of it."""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402  the built-in task and its gold score, exactly grpo.py's

import datasets  # noqa: E402
import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


class Timers:
    """Seconds spent inside wrapped callables, by part; only while `on` (the training loop)."""

    def __init__(self):
        self.seconds, self.on = {}, False

    def wrap(self, part, fn, when=lambda *a, **k: True):
        def timed(*args, **kwargs):
            if not (self.on and when(*args, **kwargs)):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model-path", default="models/sft")
    parser.add_argument("--num-iterations", type=int, default=10, help="rollouts of 256 completions")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="time generation, reward, log-probs, update")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.sft_model_path)
    stop_ids = grpo.stop_token_ids(tokenizer)
    rows = grpo.task_rows(args.seed, "train", 50_000, "prompt")  # grpo.py's training prompts
    # TRL tokenizes a text prompt with the tokenizer's special tokens, which for this ByT5 tokenizer end it with EOS;
    # grpo.py's prompts have none (encode_prompt), and a prompt that ends in EOS is another task
    tokenizer.build_inputs_with_special_tokens = lambda ids, pair=None: ids + (pair or [])
    for row in rows[:100]:
        assert tokenizer(text=[row["prompt"]])["input_ids"][0] == grpo.encode_prompt(tokenizer, row["prompt"])
    timers = Timers()

    def gold_reward(prompts, completions, completion_ids, target, **columns):
        """grpo.py's reward on the built-in task: the gold score, −1 without a stop token."""
        return [grpo.gold_score(c, t) if any(i in stop_ids for i in ids) else -1.0
                for c, t, ids in zip(completions, target, completion_ids)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), seed=args.seed, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1, steps_per_generation=4,
        num_iterations=2, max_completion_length=12, beta=0.04, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        learning_rate=1e-4, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        temperature=1.0, top_p=1.0, top_k=0, gradient_checkpointing=False, bf16=False, max_steps=args.num_iterations * 4 * 2)
    trainer = GRPOTrainer(model=args.sft_model_path, reward_funcs=timers.wrap("reward", gold_reward), args=config,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    if args.profile:  # the parts of a rollout; the rest of the loop is the update (forward, backward, AdamW)
        model = trainer.model
        model.generate = timers.wrap("generation", model.generate)
        trainer._get_per_token_logps_and_entropies = timers.wrap(
            "reference and old log-probs", trainer._get_per_token_logps_and_entropies,
            when=lambda *a, **k: not torch.is_grad_enabled())

    class LoopTime(transformers.TrainerCallback):
        """The training loop's time: from the first step's start to the last step's end."""

        def on_step_begin(self, cfg, state, control, **kwargs):
            if state.global_step == 0:
                self.start, timers.on = time.perf_counter(), True

        def on_step_end(self, cfg, state, control, **kwargs):
            self.end = time.perf_counter()

    loop = LoopTime()
    trainer.add_callback(loop)
    trainer.train()
    seconds = loop.end - loop.start
    out = {"side": "trl", "threads": torch.get_num_threads(), "completions": args.num_iterations * 256,
           "seconds": seconds, "completions_per_s": args.num_iterations * 256 / seconds}
    if args.profile:
        out["parts"] = {**timers.seconds, "update and the rest": seconds - sum(timers.seconds.values())}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
