"""The training loop's speed of scale/grpo.py or scale/rlhf_ppo.py, and where its time goes, as one JSON line: our
side of docs/scaling.md's table against TRL's GRPOTrainer (benchmarks/gpu_rollout.sh runs it).

    python benchmarks/rollout_timer.py PATH/scale/grpo.py [--profile] [--attention-math] [--eager-sampling] [flags]

The script's own `main(tyro.cli(Args))` runs in this process. completions_per_s is the script's last
charts/episodes_per_second: the completions of every iteration over the loop's time, the evaluations before and
after the loop excluded (what benchmarks/trl_grpo.py measures of TRL). With --profile, the seconds inside the loop
spent in generation (generate_in_chunks), the reward (the reward functions and the reward model), the rollout's
forward passes (old and reference log-probs, values: policy_logprobs and scalar_head without gradients) and the
rest, the update (forward, backward, AdamW), and the tokens sampled in the loop (generation tokens/s is their count
over the generation's seconds). The timers cost a few microseconds a call; on CUDA each waits for the device
(torch.cuda.synchronize) at its start and end, so that a part's seconds are its own kernels'. With --attention-math,
the whole run takes scaled_dot_product_attention's math kernel (torch.nn.attention.sdpa_kernel) instead of the flash
kernel torch picks on the CPU, whose bfloat16 backward is slow at the built-in task's short sequences; the scripts
themselves leave the choice to torch. With --eager-sampling, a script that
samples on CUDA with sample_tokens_graphed (the step as a CUDA graph) takes the eager loop, sample_tokens, instead:
the two side by side."""
import contextlib
import importlib.util
import json
import sys
import time

import torch
import tyro
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    path, flags = sys.argv[1], sys.argv[2:]
    profile, attention_math, eager = "--profile" in flags, "--attention-math" in flags, "--eager-sampling" in flags
    flags = [f for f in flags if f not in ("--profile", "--attention-math", "--eager-sampling")]
    spec = importlib.util.spec_from_file_location("script_under_test", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if eager:
        script.sample_tokens_graphed = script.sample_tokens
    state = {"on": False, "active": False, "speed": None, "iterations": 0, "tokens": 0}
    seconds = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    def timed(part, fn, when=lambda: True):
        def wrapper(*args, **kwargs):
            if not (profile and state["on"]) or state["active"] or not when():  # the outermost timed call counts
                return fn(*args, **kwargs)
            sync()
            state["active"], start = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - start
                state["active"] = False
        return wrapper

    rollout = lambda: not torch.is_grad_enabled()  # noqa: E731  the rollout's passes, not the update's
    generate_in_chunks = timed("generation", script.generate_in_chunks)

    def counted(*args, **kwargs):  # the response tokens sampled in the loop, up to each one's stop token
        out = generate_in_chunks(*args, **kwargs)
        if state["on"]:
            state["tokens"] += int(out[3].sum())
        return out
    script.generate_in_chunks = counted
    script.reward_terms = timed("reward", script.reward_terms)
    script.response_scores = timed("reward", script.response_scores)
    script.policy_logprobs = timed("rollout log-probs and values", script.policy_logprobs, rollout)
    script.scalar_head = timed("rollout log-probs and values", script.scalar_head, rollout)
    get_lr, make_writer = script.get_lr, script.make_writer

    def loop_starts(*args, **kwargs):  # each iteration begins with its learning rate
        state["on"] = True
        return get_lr(*args, **kwargs)

    def writer_that_stops_the_clock(*args, **kwargs):
        writer = make_writer(*args, **kwargs)
        add_scalar = writer.add_scalar

        def add(tag, value, step, *rest, **kw):
            if tag == "charts/episodes_per_second":  # the iteration's last figure; an evaluation may follow
                state.update(on=False, speed=float(value), iterations=step)
            return add_scalar(tag, value, step, *rest, **kw)
        writer.add_scalar = add
        return writer

    script.get_lr, script.make_writer = loop_starts, writer_that_stops_the_clock
    args = tyro.cli(script.Args, args=flags)
    if not args.anneal_lr:
        sys.exit("error: the loop's start is seen through get_lr: keep --anneal-lr")
    with sdpa_kernel(SDPBackend.MATH) if attention_math else contextlib.nullcontext():
        script.main(args)
    out = {"side": path, "threads": torch.get_num_threads(), "completions_per_s": state["speed"],
           "seconds": state["iterations"] * args.batch_size / state["speed"]}
    if profile:
        out["parts"] = {**seconds, "update and the rest": out["seconds"] - sum(seconds.values())}
        out["generated_tokens"] = state["tokens"]
        out["generation_tokens_per_s"] = state["tokens"] / seconds["generation"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
