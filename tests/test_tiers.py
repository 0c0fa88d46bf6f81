"""The two tiers compute the same thing. Each top-level LM script (the one-device reference) and its scale/
sibling (the full program) run in this process, one after the other, on the CPU in float32 (--no-cuda --no-bf16,
on any machine), with the same seed and the flags both accept. They must log the same scalars (the wall-clock
ones aside) and save the same weights.

Bitwise where the computation is the same. Where it is not, to a tolerance, for the one reason each case names:
scale/'s head_logprobs applies the LM head a chunk of positions at a time inside the forward pass and takes the
log-softmax per chunk, where sft.py and dpo.py take one log_softmax over the whole logits: the same numbers
summed in another order, a few float32 ulps apart per step (grpo.py: see TIERS). Sampling does not go through those
log-probs, so what depends only on the tokens sampled (gold accuracy and score, rewards, lengths) must still be
equal: the same tokens were sampled."""
import glob
import json
import os

import pytest
import torch
from conftest import CPU_FLOAT32, TINY_LM, read_scalars, reward_model_for, run_in_process

WALL_CLOCK = ("per_second", "time_fraction")


def run(script, flags, cwd):
    """(scalars without the wall-clock ones, {weight name: tensor} of every saved safetensors file) of one run."""
    from safetensors.torch import load_file

    os.makedirs(cwd)
    run_in_process(script, *CPU_FLOAT32, *flags, cwd=cwd)
    (run_dir,) = glob.glob(str(cwd / "runs" / "*"))
    scalars = {tag: values for tag, values in read_scalars(run_dir).items() if not any(w in tag for w in WALL_CLOCK)}
    weights = {}
    for path in sorted(glob.glob(str(cwd / "models" / "*" / "*.safetensors"))):
        weights.update(load_file(path))
    return scalars, weights


def flags_of(script, checkpoints):
    """Short runs. The length limits bind: --max-length 20 here and --max-prompt-length 12 in the RL variants drop
    the built-in task's examples and prompts of 7 and 8 digits, so a tier that read either at its default (64) would
    train on others."""
    sft, reward_model = str(checkpoints["sft"]), str(checkpoints["reward_model"])
    return {
        "sft": [*TINY_LM, "--max-steps", "20", "--eval-every", "10", "--num-train-examples", "400", "--eval-size", "16",
                "--batch-size", "16", "--max-length", "20", "--lr", "6e-4"],  # the rounding noise Adam steps stays small
        "reward_model": ["--model-name-or-path", sft, "--max-steps", "20", "--eval-every", "10",
                         "--num-train-pairs", "400", "--eval-size", "32", "--batch-size", "16",
                         "--max-length", "20"],
        "dpo": ["--model-name-or-path", sft, "--reward-model-path", reward_model,
                "--max-steps", "20", "--eval-every", "10", "--num-train-pairs", "400", "--eval-size", "16",
                "--batch-size", "16"],
        "rlhf_ppo": ["--model-name-or-path", sft, "--reward-model-path", reward_model,
                     "--num-iterations", "3", "--batch-size", "16", "--mini-batch-size", "8", "--ppo-epochs", "2",
                     "--eval-every", "2", "--eval-size", "16"],
        "grpo": ["--model-name-or-path", sft, "--num-iterations", "3", "--batch-size", "16",
                 "--num-generations", "4", "--mini-batch-size", "8", "--ppo-epochs", "2", "--eval-every", "2",
                 "--eval-size", "16"],
    }[script]


# script: None (bitwise); or (the tags that must still be equal, the weights' tolerance) where scale/ computes the
# log-probs another way: its chunked LM head (sft, dpo, rlhf_ppo), and in grpo also its shared-prompt pass on the
# CPU (the prompt's keys and values computed once for the G completions, then the responses). Adam divides each step
# by √v: a weight whose gradient is near 0 moves by up to lr either way on rounding alone, so the RL scripts'
# weights hold to their lr (1e-4, 1.5e-4).
# The logged values hold to 1e-5 + rtol |b| (a KL near 0 is a difference of two sums of about −40: its error is
# absolute). rtol is 1e-5 for the supervised scripts; for the RL scripts 2e-2, since what they log after an update
# comes from weights that hold only to their lr: on a 2-core x86 CI machine 1e-5 holds, but on another CPU and torch build
# (an H200 host's, torch 2.11) grpo's eval/kl after two updates moved by 1%.
# The key bias has no gradient in exact arithmetic (softmax does not change when every key logit of a query shifts by
# the same q·b_k), so its gradient is rounding noise, which Adam scales to a step of about lr either way at each of
# the RL runs' 3 iterations × 2 epochs × 2 minibatches: it holds to lr × steps (seen: 1.4 lr), the rest to lr.
KEY_BIAS_STEPS = 12
SAMPLED = ["eval/gold_accuracy", "eval/gold_score"]
TIERS = {"sft": (SAMPLED + ["eval/gold_accuracy_greedy", "eval/gold_score_greedy"], 1e-5, 1e-5),
         "reward_model": None,
         "dpo": (SAMPLED + ["eval/accuracy", "train/accuracy", "charts/learning_rate"], 1e-5, 1e-5),
         "rlhf_ppo": (SAMPLED + ["objective/reward", "objective/score", "val/num_eos", "policy/first_ratio_max_error",
                                 "eval/reward", "eval/score"], 1.5e-4, 2e-2),
         "grpo": (SAMPLED + ["objective/reward", "objective/completion_length", "policy/first_ratio_max_error",
                             "eval/reward"], 1e-4, 2e-2)}


PARTIAL = """def some(prompts, completions, **columns):
    # None (does not apply) where the prompt has an odd number of digits ("sort 123:": "123:" has an even length)
    return [None if len(p.split()[1]) % 2 == 0 else float(len(c) % 3 == 0) for p, c in zip(prompts, completions)]


def none(prompts, completions, **columns):
    return [None] * len(completions)
"""


def variant_flags(variant, checkpoints, tmp_path):
    """Flags that take every loss-shaping flag both tiers accept off its default, at values where it binds (a clip
    that clips, a KL controller that moves the coefficient by more than the 2% the RL logs hold to): a scale/ flag
    ignored at its default value would pass the default run. The RL variants run from the small checkpoints,
    whose completions stop and score above 0, so that the reward's terms and weights show, and stop at 7 tokens.
    The longest answer --max-prompt-length 12 leaves, 6 digits and the stop token, fits them: a completion runs to
    the limit only where the model writes too much (some of rlhf_ppo-terms', none of grpo-rloo-cispo's), so
    grpo-truncated is the case where completions are cut."""
    # a reward function that applies to some completions only (None elsewhere) and one that applies to none: each
    # term's mean is over the completions it applies to, and a term that applies to none is not logged. Weighted 0,
    # they leave what the runs train as it was (bitwise; only eval/reward's float32 rounding moves)
    (tmp_path / "partial.py").write_text(PARTIAL)
    partial = ["--reward-fn", f"{tmp_path / 'partial.py'}:some", "--reward-fn", f"{tmp_path / 'partial.py'}:none"]
    if variant == "reward_model-margin":  # a margin column, the centering term, a clip that clips
        rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f"{i}{i + 1}", "rejected": f"{i + 1}{i}",
                 "margin": 0.5 * (i % 3)} for i in range(8)] * 8
        (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
        return ["--dataset-name", str(tmp_path / "prefs.jsonl"), "--center-rewards-coefficient", "0.01",
                "--max-grad-norm", "0.01", "--eval-size", "8"]
    return {
        "sft-pretrained": ["--model-name-or-path", str(checkpoints["sft"])],  # fine-tuning a checkpoint, not the tiny GPT-2
        "dpo-ipo": ["--loss-type", "ipo", "--beta", "0.3", "--max-grad-norm", "0.01", "--max-length", "20"],
        "rlhf_ppo-terms": ["--reward-fn", "gold", "--reward-fn", "format", "--format-pattern", "[0-4]*", *partial,
                           "--reward-weights", "0.5", "0.25", "0", "0", "1", "--kl-target", "1.0", "--kl-horizon",
                           "20", "--missing-eos-penalty", "-2", "--cliprange", "0.1", "--cliprange-value", "0.1",
                           "--vf-coef", "0.3", "--gamma", "0.95", "--lam", "0.9", "--temperature", "0.8",
                           "--response-length", "7", "--max-prompt-length", "12", "--eval-num-samples", "2",
                           "--log-completions-every", "1"],
        "grpo-rloo-cispo": ["--advantage", "rloo", "--loss-type", "cispo", "--epsilon-high", "1.001",  # a cap that caps
                            "--mask-truncated-completions", "--soft-overlong-cache", "4", "--beta", "1.0",
                            "--reward-fn", "gold", "--reward-fn", "format", "--format-pattern", "[0-4]*", *partial,
                            "--reward-model-path", str(checkpoints["reward_model"]),
                            "--reward-weights", "0.5", "0.25", "0", "0", "1", "--no-anneal-lr", "--temperature", "0.8",
                            "--missing-eos-penalty", "-2", "--response-length", "7", "--max-prompt-length", "12"],
        "rlhf_ppo-kl_coef": ["--kl-coef", "0.3"],  # the cases above run at its default, 1.0
        # most of the tiny SFT model's completions run to the limit here; in grpo-rloo-cispo every one stops. A
        # token-level loss, whose normalizer counts the tokens the filter leaves (grpo's per-completion mean does not)
        "grpo-truncated": ["--mask-truncated-completions", "--response-length", "6", "--loss-type", "dapo"],
        # GSPO's sequence-level ratio with its small ε, REINFORCE++'s batch normalization, pass@k and the samples
        "grpo-gspo": ["--importance-sampling-level", "sequence", "--epsilon", "3e-4", "--epsilon-high", "4e-4",
                      "--advantage", "reinforce_pp_baseline", "--eval-num-samples", "2", "--log-completions-every", "1"],
        "grpo-dr_grpo": ["--scale-rewards", "none", "--loss-type", "dr_grpo", "--epsilon-high", "0.001", "--dynamic-sampling",
                         "--max-sampling-rounds", "2"],
    }.get(variant, [])


CASES = list(TIERS) + ["sft-pretrained", "reward_model-margin", "dpo-ipo", "rlhf_ppo-terms", "grpo-rloo-cispo",
                       "grpo-dr_grpo", "grpo-truncated", "rlhf_ppo-kl_coef", "grpo-gspo"]
# the tags scale/ logs of what the reference does not have: the sampler against π_old (its off-policy machinery)
SCALE_ONLY_TAGS = ("rollout/",)


@pytest.mark.parametrize("case", CASES)
def test_the_reference_and_its_scale_sibling_compute_the_same(tiny_checkpoints, small_checkpoints, tmp_path, case):
    """The default flags, and variants that take every loss-shaping flag both tiers accept off its default."""
    script = case.split("-")[0]
    checkpoints = small_checkpoints if case in ("rlhf_ppo-terms", "grpo-rloo-cispo", "grpo-gspo") else tiny_checkpoints
    flags = flags_of(script, checkpoints) + variant_flags(case, checkpoints, tmp_path)
    # and scale/ in 2 micro-batches a minibatch where a normalizer counts tokens of the whole minibatch (dapo's)
    accumulate = {"grpo-truncated": ["--gradient-accumulation-steps", "2"]}.get(case, [])
    (logs, weights), (scale_logs, scale_weights) = (run(path, flags + ["--output-dir", f"models/{script}"] + more,
                                                        tmp_path / path.replace("/", "_"))
                                                    for path, more in ((f"{script}.py", []),
                                                                       (f"scale/{script}.py", accumulate)))
    scale_logs = {tag: v for tag, v in scale_logs.items() if not tag.startswith(SCALE_ONLY_TAGS)}
    assert set(logs) == set(scale_logs) and len(logs) >= 5, (sorted(logs), sorted(scale_logs))
    if case in ("rlhf_ppo-terms", "grpo-rloo-cispo"):  # `some` is logged; `none` (it applies to no completion) is not
        assert {"rewards/some", "eval/rewards/some"} <= set(logs) and not [
            tag for tag in logs if "none" in tag and not tag.endswith(("_timeouts", "_errors"))]  # its calls: counted
    binding = {"grpo-rloo-cispo": ["policy/clipfrac"], "grpo-gspo": ["policy/clipfrac"]}.get(case, [])  # not 0
    assert all(max(v for _, v in logs[tag]) > 0 for tag in binding), {tag: logs.get(tag) for tag in binding}
    assert case != "grpo-gspo" or {"eval/pass@1", "eval/pass@2"} <= set(logs)
    assert set(weights) == set(scale_weights) and weights
    if TIERS[script] is None:  # the same computation: bitwise
        assert [tag for tag in logs if logs[tag] != scale_logs[tag]] == []
        assert [name for name in weights if not torch.equal(weights[name], scale_weights[name])] == []
        return
    exact, atol, rtol = TIERS[script]
    exact = [tag for tag in exact if "--dataset-name" not in flags or "gold" not in tag]  # a dataset has no gold
    assert [tag for tag in exact if logs[tag] != scale_logs[tag]] == [] and all(tag in logs for tag in exact)
    for tag in logs:
        assert [s for s, _ in logs[tag]] == [s for s, _ in scale_logs[tag]], tag
    apart = {tag: (logs[tag], scale_logs[tag]) for tag in logs
             if any(abs(a - b) > 1e-5 + rtol * abs(b) for (_, a), (_, b) in zip(logs[tag], scale_logs[tag]))}
    assert apart == {}, apart
    for name in weights:
        ours, theirs = weights[name], scale_weights[name]
        if script in ("rlhf_ppo", "grpo") and name.endswith("attn.c_attn.bias"):  # query, key, value: KEY_BIAS_STEPS
            n = len(ours) // 3
            torch.testing.assert_close(ours[n : 2 * n], theirs[n : 2 * n], rtol=0, atol=atol * KEY_BIAS_STEPS, msg=name)
            ours, theirs = torch.cat([ours[:n], ours[2 * n :]]), torch.cat([theirs[:n], theirs[2 * n :]])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol, msg=name)


def vapo_flags(tmp_path):
    """VC-PPO's and VAPO's knobs (scale/rlhf_ppo.py's alone), each at a value where it binds: prompts of the digits 0-5,
    where a response passes (the format) where it has no 5."""
    rows = [{"prompt": f"sort {i % 6}{i // 6 % 6}{i // 36 % 6}{i % 5}:"} for i in range(200)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    return ["--dataset-name", str(tmp_path / "prompts.jsonl"), "--reward-fn", "format", "--format-pattern", "[0-4]*",
            "--critic-lam", "1.0", "--length-adaptive-lam", "0.5", "--value-warmup-steps", "2", "--cliprange-high",
            "0.28", "--positive-lm-coef", "0.5", "--response-length", "7"]


def test_a_variant_of_scale_alone_computes_the_same_in_micro_batches(small_checkpoints, tmp_path):
    """A variant only scale/ has no reference to compare with; what scale/ adds to it (micro-batches whose normalizers
    count the tokens of the whole minibatch: VAPO's positive-example term) must compute what one micro-batch does.
    scale/rlhf_ppo.py with VC-PPO's and VAPO's knobs, in 1 and in 2 micro-batches a minibatch: the same tags, the
    sampled ones equal, the rest to the tier tolerance of rlhf_ppo."""
    rm = reward_model_for(small_checkpoints["reward_model"], tmp_path / "rm", "prefs.jsonl")  # one for the dataset
    flags = (flags_of("rlhf_ppo", small_checkpoints) + vapo_flags(tmp_path)
             + ["--reward-model-path", rm, "--output-dir", "models/rlhf_ppo"])
    (logs, weights), (split_logs, split_weights) = (run("scale/rlhf_ppo.py", flags + more, tmp_path / name) for name, more in
                                                    (("one", []), ("two", ["--gradient-accumulation-steps", "2"])))
    assert set(logs) == set(split_logs) and {"losses/positive_lm_loss", "val/warmup_value_loss"} <= set(logs)
    assert all(max(v for _, v in logs[tag]) > 0 for tag in ("losses/positive_lm_loss", "val/warmup_value_loss"))
    exact, atol, rtol = TIERS["rlhf_ppo"]
    exact = [tag for tag in exact if "gold" not in tag]  # a dataset has no gold
    assert [tag for tag in exact if logs[tag] != split_logs[tag]] == []
    apart = {tag: (logs[tag], split_logs[tag]) for tag in logs
             if any(abs(a - b) > 1e-5 + rtol * abs(b) for (_, a), (_, b) in zip(logs[tag], split_logs[tag]))}
    assert apart == {}, apart
    for name in weights:  # the key bias to KEY_BIAS_STEPS × lr (rounding noise, see above), the rest to lr
        key_bias = name.endswith("attn.c_attn.bias")
        torch.testing.assert_close(weights[name], split_weights[name], rtol=0,
                                   atol=atol * (KEY_BIAS_STEPS if key_bias else 1), msg=name)
