"""TRL's GRPOTrainer on grpo.py's built-in task with grpo.py's defaults, for docs/scaling.md's table
(benchmarks/gpu_rollout.sh). It runs in TRL's own virtual environment (docs/scaling.md says how to make it), never in
this repo's:

    TRL_PYTHON benchmarks/trl_grpo.py --model-name-or-path models/sft --num-iterations 10 [--profile]

On a GPU (benchmarks/gpu_rollout.sh), with a model and a .jsonl of prompts and targets, rewarded by exact match as
grpo.py's --reward-fn exact_match, in bfloat16 autocast over float32 weights as grpo.py's --bf16:

    TRL_PYTHON benchmarks/trl_grpo.py --gpu --model-name-or-path M --dataset-name prompts.jsonl --response-length 128 \
        --micro-batch-size 16 --profile

The model, tokenizer and prompts are those of grpo.py (its task functions are imported from it); the reward is the
gold score, or −1 for a completion with no stop token (grpo.py's --missing-eos-penalty). Settings matched to
grpo.py: G = 8, 256 completions per rollout (steps_per_generation 4 × 64), minibatches of 64, μ = 2
(num_iterations), 12 new tokens, β = 0.04, ε = 0.2, loss "grpo", rewards scaled by the group's std, AdamW lr 1e-4
(weight decay 0.01, torch's default) annealed linearly to 0, gradient norm clipped to 1, temperature 1, no top-k /
top-p, dropout off, float32 (--gpu: bfloat16 autocast over float32 weights) and no gradient checkpointing (TRL's
defaults turn on bf16 and checkpointing). Prints one JSON line: the completions per second of the training loop
(from the first step's start to the last step's end, as grpo.py's charts/episodes_per_second) and, with --profile,
the seconds spent in each part of it (on CUDA each timer waits for the device at its start and end) and the tokens
generated, up to each completion's stop token."""
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
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import grpo  # noqa: E402  the built-in task and its gold score, exactly grpo.py's


class Timers:
    """Seconds spent inside wrapped callables, by part; only while `on` (the training loop)."""

    def __init__(self):
        self.seconds, self.on, self.tokens = {}, False, 0
        self.sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    def wrap(self, part, fn, when=lambda *a, **k: True):
        def timed(*args, **kwargs):
            if not (self.on and when(*args, **kwargs)):
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name-or-path", default="models/sft")
    parser.add_argument("--num-iterations", type=int, default=10, help="rollouts of --batch-size completions")
    parser.add_argument("--dataset-name", default=None, help=".jsonl of prompts and targets (default: the built-in task)")
    parser.add_argument("--response-length", type=int, default=12, help="new tokens per completion")
    parser.add_argument("--batch-size", type=int, default=256, help="completions per rollout")
    parser.add_argument("--mini-batch-size", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=64, help="completions per forward and backward pass")
    parser.add_argument("--gpu", action="store_true", help="CUDA, bfloat16 autocast over float32 weights")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="time generation, reward, log-probs, update")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
    stop_ids = grpo.stop_token_ids(tokenizer)
    if args.dataset_name is None:
        rows = grpo.task_rows(args.seed, "train", 50_000, grpo.prompt_row)  # grpo.py's training prompts
        score = grpo.gold_score
    else:
        rows = [json.loads(line) for line in open(args.dataset_name)]
        score = lambda c, t: grpo.exact_match([None], [c], [t])[0]  # noqa: E731  grpo.py's --reward-fn exact_match
    # TRL tokenizes a text prompt with the tokenizer's special tokens, which for this ByT5 tokenizer end it with EOS;
    # grpo.py's prompts have none (encode_prompt), and a prompt that ends in EOS is another task
    tokenizer.build_inputs_with_special_tokens = lambda ids, pair=None: ids + (pair or [])
    for row in rows[:100]:
        assert tokenizer(text=[row["prompt"]])["input_ids"][0] == grpo.encode_prompt(tokenizer, row["prompt"])
    timers = Timers()

    def gold_reward(prompts, completions, completion_ids, target, **columns):
        """grpo.py's reward: the gold score (or exact match), −1 without a stop token."""
        if timers.on:
            timers.tokens += sum(len(ids) for ids in completion_ids)  # each completion up to its stop token
        return [score(c, t) if any(i in stop_ids for i in ids) else -1.0
                for c, t, ids in zip(completions, target, completion_ids)]

    steps = args.batch_size // args.micro_batch_size  # forward and backward passes per pass over a rollout
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), seed=args.seed, use_cpu=not args.gpu, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        num_generations=8, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.mini_batch_size // args.micro_batch_size, steps_per_generation=steps,
        num_iterations=2, max_completion_length=args.response_length, beta=0.04, epsilon=0.2, loss_type="grpo",
        scale_rewards="group", learning_rate=1e-4, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01,
        max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0, gradient_checkpointing=False, bf16=args.gpu,
        model_init_kwargs={"dtype": torch.float32},  # float32 master weights, as grpo.py's (--bf16: autocast)
        max_steps=args.num_iterations * (args.batch_size // args.mini_batch_size) * 2)
    trainer = GRPOTrainer(model=args.model_name_or_path, reward_funcs=timers.wrap("reward", gold_reward), args=config,
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
    completions = args.num_iterations * args.batch_size
    out = {"side": "trl", "threads": torch.get_num_threads(), "completions": completions,
           "seconds": seconds, "completions_per_s": completions / seconds}
    if args.profile:
        out["parts"] = {**timers.seconds, "update and the rest": seconds - sum(timers.seconds.values())}
        out["generated_tokens"] = timers.tokens
        out["generation_tokens_per_s"] = timers.tokens / timers.seconds["generation"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
