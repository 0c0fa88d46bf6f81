"""Break a script on purpose, run its tests, and say which fail: the check that a test guards what it claims to.

Each break below changes one line of one script, in a copy of the repository (the checkout is never touched),
then runs that script's test file; a break that no test catches is a hole in the tests.

    python benchmarks/deliberate_breaks.py                    # every break, one after another
    python benchmarks/deliberate_breaks.py grpo_loss_sign     # one
    python benchmarks/deliberate_breaks.py --list
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (script, the text replaced, what replaces it, the test file that must fail)
BREAKS = {
    "grpo_keeps_equal_groups": ("grpo.py", "groups = torch.argsort((~informative).int(), stable=True)[: B // G]",
                                "groups = groups", "tests/test_grpo.py"),
    "grpo_overlong_sign": ("grpo.py", "((max_length - cache - lengths) / cache).clamp(-1.0, 0.0)",
                           "((lengths - max_length + cache) / cache).clamp(-1.0, 0.0)", "tests/test_grpo.py"),
    "grpo_overlong_not_applied": ("grpo.py", "        if args.soft_overlong_cache:  # a completion that stops near the limit",
                                  "        if False:  # a completion that stops near the limit", "tests/test_grpo.py"),
    "grpo_sampling_rounds_not_agreed": ("scale/grpo.py", 'short = all_reduce_sum({"short": max(0, prompts_per_rank - int(informative.sum()))}, device)["short"]',
                                        "short = max(0, prompts_per_rank - int(informative.sum()))", "tests/test_resume.py"),
    "sft_loss_sign": ("sft.py", "loss = sft_loss(logprobs, labels)", "loss = -sft_loss(logprobs, labels)",
                      "tests/test_sft.py"),
    "sft_loss_on_the_prompt": ("sft.py", "loss = sft_loss(logprobs, labels)",
                               "loss = sft_loss(gather_logprobs(logits, next_tokens(input_ids)), input_ids)",
                               "tests/test_sft.py"),
    # scale/: an algorithm's line in the full program, caught where the two tiers stop computing the same thing
    "scale_sft_loss_sign": ("scale/sft.py", "loss = sft_loss(logprobs, labels, num_items)",
                            "loss = -sft_loss(logprobs, labels, num_items)", "tests/test_tiers.py"),
    "scale_reward_model_swapped_pairs": ("scale/reward_model.py", "loss = bradley_terry_loss(r_c, r_r, margin,",
                                         "loss = bradley_terry_loss(r_r, r_c, margin,", "tests/test_tiers.py"),
    "scale_dpo_swapped_in_the_update": ("scale/dpo.py", "dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta",
                                        "dpo_loss(rejected, chosen, ref_rejected, ref_chosen, args.beta",
                                        "tests/test_tiers.py"),
    "scale_dpo_reference_is_the_policy": ("scale/dpo.py", "    ref = place_model(ref, device, args, trained=False)\n",
                                          "    ref = place_model(ref, device, args, trained=False)\n    ref = policy\n",
                                          "tests/test_tiers.py"),
    "reward_model_swapped_pairs": ("reward_model.py", "loss = bradley_terry_loss(r_c, r_r, margin,",
                                   "loss = bradley_terry_loss(r_r, r_c, margin,", "tests/test_reward_model.py"),
    "dpo_swapped_in_the_update": ("dpo.py", "dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta",
                                  "dpo_loss(rejected, chosen, ref_rejected, ref_chosen, args.beta", "tests/test_dpo.py"),
    "dpo_references_swapped_in_the_loss": ("dpo.py", "rejected_logratios = policy_rejected_logps - ref_rejected_logps",
                                           "rejected_logratios = policy_rejected_logps - ref_chosen_logps",
                                           "tests/test_dpo.py"),
    "dpo_reference_is_the_policy": ("dpo.py", "    tokenizer, stop_ids, policy, ref, reward = load_models(args, device)\n",
                                    "    tokenizer, stop_ids, policy, ref, reward = load_models(args, device)\n    ref = policy\n",
                                    "tests/test_dpo.py"),
    "grpo_kl_sign": ("grpo.py", "kl_penalty = args.beta * aggregate_loss(new_k3", "kl_penalty = -args.beta * aggregate_loss(new_k3",
                     "tests/test_grpo.py"),
    "grpo_kl_to_the_rollout_policy": ("grpo.py", "_, new_k3 = kl_estimators(logprobs, ref_logprobs[mb], loss_mask[mb])",
                                      "_, new_k3 = kl_estimators(logprobs, old_logprobs[mb], loss_mask[mb])",
                                      "tests/test_grpo.py"),
    "rlhf_ppo_no_missing_eos_penalty": ("rlhf_ppo.py",
                                        "        scores = torch.where(has_stop, scores, torch.full_like(scores, args.missing_eos_penalty))\n",
                                        "", "tests/test_rlhf_ppo.py"),
    "grpo_loss_sign": ("grpo.py", "    return -torch.min(ratio * advantages,", "    return torch.min(ratio * advantages,",
                       "tests/test_grpo.py"),
    "grpo_advantage_sign": ("grpo.py", "advantages = group_advantages(rewards, G, args.scale_rewards)",
                            "advantages = -group_advantages(rewards, G, args.scale_rewards)", "tests/test_grpo.py"),
    "grpo_ignores_no_scale_rewards": ("grpo.py", "advantages = group_advantages(rewards, G, args.scale_rewards)",
                                      "advantages = group_advantages(rewards, G)", "tests/test_grpo.py"),
    "rlhf_ppo_loss_sign": ("rlhf_ppo.py", "(pg_loss + args.vf_coef * vf_loss).backward()",
                           "(-pg_loss + args.vf_coef * vf_loss).backward()", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_value_loss_sign": ("rlhf_ppo.py", "(pg_loss + args.vf_coef * vf_loss).backward()",
                                 "(pg_loss - args.vf_coef * vf_loss).backward()", "tests/test_rlhf_ppo.py"),
    "scale_rlhf_ppo_loss_sign": ("scale/rlhf_ppo.py", "((pg_loss + args.vf_coef * vf_loss) * world_size).backward()",
                                 "((-pg_loss + args.vf_coef * vf_loss) * world_size).backward()", "tests/test_tiers.py"),
    "scale_grpo_advantage_sign": ("scale/grpo.py", "advantages = group_advantages(rewards, G, args.scale_rewards)",
                                  "advantages = -group_advantages(rewards, G, args.scale_rewards)", "tests/test_tiers.py"),
    "rlhf_ppo_gamma_lambda_swapped": ("rlhf_ppo.py", "masked_gae(rewards, values, mask, args.gamma, args.lam)",
                                      "masked_gae(rewards, values, mask, args.lam, args.gamma)", "tests/test_rlhf_ppo.py"),
    "ppo_clip_gamma_lambda_swapped": ("ppo_clip.py", "args.gamma, args.gae_lambda)", "args.gae_lambda, args.gamma)",
                                      "tests/test_ppo_clip.py"),
    "ppo_clip_loss_sign": ("ppo_clip.py", "loss = pg_loss - args.ent_coef", "loss = -pg_loss - args.ent_coef",
                           "tests/test_ppo_clip.py"),
    "ppo_clip_no_advantage_normalization": ("ppo_clip.py", "                if args.norm_adv:\n                    mb_advantages =",
                                            "                if False:\n                    mb_advantages =",
                                            "tests/test_ppo_clip.py"),
    "ppo_kl_gamma_lambda_swapped": ("ppo_kl.py", "args.gamma, args.gae_lambda)", "args.gae_lambda, args.gamma)",
                                    "tests/test_ppo_kl.py"),
    "ppo_continuous_gamma_lambda_swapped": ("ppo_continuous.py", "args.gamma, args.gae_lambda)",
                                            "args.gae_lambda, args.gamma)", "tests/test_ppo_continuous.py"),
    "ppo_continuous_no_reward_scaling": ("ppo_continuous.py", "rewards[step] = scale_reward(reward, return_rms.var, args.clip_reward)",
                                         "rewards[step] = reward", "tests/test_ppo_continuous.py"),
    "ppo_continuous_raw_final_observation": ("ppo_continuous.py",
                                             'final_obs = process_obs(np.stack(infos["final_obs"][truncated]), update=False)',
                                             'final_obs = np.stack(infos["final_obs"][truncated]).astype(np.float32)',
                                             "tests/test_ppo_continuous.py"),
    "sigterm_on_one_rank_only": ("scale/sft.py", 'sigterm = bool(all_reduce_sum({"sigterm": preemption.received}, device)["sigterm"])',
                                 "sigterm = preemption.received", "tests/test_resume.py"),
    # the 8-GPU path (tests/test_scaling.py; scale/dpo.py's copy: every copy is one text, tests/test_copies.py)
    "every_rank_reads_the_checkpoint": ("scale/dpo.py", "        if dist.is_initialized() and dist.get_rank() != 0:\n            with torch.device(\"meta\"):",
                                        "        if False:\n            with torch.device(\"meta\"):", "tests/test_scaling.py"),
    "buffers_not_broadcast": ("scale/dpo.py", "    for buffer in model.buffers():\n        dist.broadcast(buffer, src=0)\n", "",
                              "tests/test_scaling.py"),
    "tied_weights_not_tied_again": ("scale/dpo.py", "                setattr(model.get_submodule(module), attribute, model.get_parameter(first))",
                                    "                pass", "tests/test_scaling.py"),
    "frozen_root_not_resharded": ("scale/dpo.py", "            model.register_forward_hook(lambda module, inputs, output: module.reshard())",
                                  "            pass", "tests/test_scaling.py"),
    "run_directory_not_checked": ("scale/sft.py", '    blind = int(all_reduce_sum({"blind": not seen}, device)["blind"])',
                                  "    blind = 0", "tests/test_scaling.py"),
    "gradients_kept_through_the_rollout": ("scale/grpo.py", "                optimizer.zero_grad(set_to_none=True)  # no gradients held through the next rollout\n",
                                           "", "tests/test_scaling.py"),
    "evaluation_at_128": ("scale/sft.py", "    eval_batch_size = args.eval_batch_size or micro_size",
                          "    eval_batch_size = args.eval_batch_size or 128", "tests/test_scaling.py"),
    "head_chunks_not_recomputed": ("scale/dpo.py", "        parts = [checkpoint(chunk, h, y, use_reentrant=False) if grad else chunk(h, y)",
                                   "        parts = [chunk(h, y)", "tests/test_scaling.py"),
    "softcapping_skipped": ("scale/dpo.py", "        z = (torch.tanh(z / cap) * cap if cap else z) / temperature",
                            "        z = z / temperature", "tests/test_scaling.py"),
}


def run(name, keyword=None):
    """Apply one break in a copy of the repository, run its test file; returns (the failed tests, pytest's last line)."""
    script, old, new, tests = BREAKS[name]
    with tempfile.TemporaryDirectory(prefix=f"break_{name}_") as copy:
        shutil.copytree(ROOT, copy, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "venv", "runs", "models", "__pycache__"))
        path = os.path.join(copy, script)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.count(old) != 1:
            sys.exit(f"error: break {name}: the text to replace is in {script} {text.count(old)} times, not once")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", tests]
        proc = subprocess.run(cmd + (["-k", keyword] if keyword else []), cwd=copy, capture_output=True, text=True)
    failed = re.findall(r"^FAILED \S+::(\S+)", proc.stdout, flags=re.M)
    return failed, (proc.stdout.strip().splitlines() or ["(no output)"])[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="breaks to run (all by default)")
    parser.add_argument("-k", dest="keyword", help="run only the tests pytest -k selects")
    parser.add_argument("--list", action="store_true", help="list the breaks and exit")
    args = parser.parse_args()
    if args.list:
        for name, (script, old, new, tests) in BREAKS.items():
            print(f"{name}: {script}: {old.strip()!r} -> {new.strip()!r} ({tests})")
        return
    for name in args.names or BREAKS:
        if name not in BREAKS:
            sys.exit(f"error: no break {name!r}; --list shows them")
        failed, summary = run(name, args.keyword)
        print(f"| {name} | {BREAKS[name][3]} | {', '.join(failed) or 'NONE FAILS'} | {summary} |", flush=True)


if __name__ == "__main__":
    main()
