"""Break a script on purpose, run its tests, and say which fail: the check that a test guards what it claims to
(docs/tests.md says how to run it).

Each break below changes one line of one script, in a copy of the repository (the checkout is never touched),
then runs that script's test file; a break that no test catches is a hole in the tests.

    python benchmarks/deliberate_breaks.py                    # every break, one after another
    python benchmarks/deliberate_breaks.py grpo_loss_sign     # one
    python benchmarks/deliberate_breaks.py --list
    python benchmarks/deliberate_breaks.py -n 2 ...             # each test file on 2 pytest-xdist workers
    python benchmarks/deliberate_breaks.py --scale grpo_kl_sign # the same line broken in scale/grpo.py instead
    python benchmarks/deliberate_breaks.py -x NAME ...          # stop at the first failing test (enough to show
                                                                # that a break is caught; the list is then partial)
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the next batch of examples (sft.py) or pairs (reward_model.py, dpo.py), one text in the three files
NEXT_BATCH = """        if position + args.batch_size > len(order):  # a new pass over the data, reshuffled
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
"""
# and scale/dpo.py's, which takes the indices of the pairs (each rank collates its share)
SCALE_DPO_NEXT_BATCH = NEXT_BATCH.replace("batch = [train[i] for i in order[position : position + args.batch_size]]",
                                          "idx = order[position : position + args.batch_size]")

# where load_data reads the dataset's config and split, and the built-in task's seed and eval size
LOAD_ROWS = "load_rows(args.dataset_name, args.dataset_config, args.dataset_split, args.eval_size)"
TASK_ROWS = 'task_rows(args.seed, "train", num_train, task_row), task_rows(args.seed, "eval", args.eval_size, task_row)'

# name: (script, the text replaced, what replaces it, the test file that must fail)
BREAKS = {
    "grpo_keeps_equal_groups": ("grpo.py", "groups = torch.argsort((~informative).int(), stable=True)[: B // G]",
                                "groups = groups", "tests/test_grpo.py"),
    "grpo_overlong_sign": ("grpo.py", "((max_length - cache - lengths) / cache).clamp(-1.0, 0.0)",
                           "((lengths - max_length + cache) / cache).clamp(-1.0, 0.0)", "tests/test_grpo.py"),
    "grpo_overlong_not_applied": ("grpo.py", "    if args.soft_overlong_cache:  # a completion that stops near the limit",
                                  "    if False:  # a completion that stops near the limit", "tests/test_grpo.py"),
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
                                        "    scores = torch.where(has_stop, scores, torch.full_like(scores, args.missing_eos_penalty))\n",
                                        "", "tests/test_rlhf_ppo.py"),
    "grpo_loss_sign": ("grpo.py", "    return -torch.min(ratio * advantages,", "    return torch.min(ratio * advantages,",
                       "tests/test_grpo.py"),
    "grpo_advantage_sign": ("grpo.py", "return group_advantages(rewards, num_generations, scale_rewards)",
                            "return -group_advantages(rewards, num_generations, scale_rewards)", "tests/test_grpo.py"),
    "grpo_ignores_no_scale_rewards": ("grpo.py", "return group_advantages(rewards, num_generations, scale_rewards)",
                                      "return group_advantages(rewards, num_generations)", "tests/test_grpo.py"),
    "rlhf_ppo_loss_sign": ("rlhf_ppo.py", "(pg_loss + args.vf_coef * vf_loss).backward()",
                           "(-pg_loss + args.vf_coef * vf_loss).backward()", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_value_loss_sign": ("rlhf_ppo.py", "(pg_loss + args.vf_coef * vf_loss).backward()",
                                 "(pg_loss - args.vf_coef * vf_loss).backward()", "tests/test_rlhf_ppo.py"),
    "scale_rlhf_ppo_loss_sign": ("scale/rlhf_ppo.py", "((pg_loss + args.vf_coef * vf_loss) * world_size).backward()",
                                 "((-pg_loss + args.vf_coef * vf_loss) * world_size).backward()", "tests/test_tiers.py"),
    "scale_grpo_advantage_sign": ("scale/grpo.py", "return group_advantages(rewards, num_generations, scale_rewards)",
                                  "return -group_advantages(rewards, num_generations, scale_rewards)", "tests/test_tiers.py"),
    # scale/'s whitening and REINFORCE++ normalization over every rank: each rank's own statistics instead
    "scale_whiten_per_rank": ("scale/rlhf_ppo.py", "    sums = torch.stack([(x * mask).sum(), mask.sum()])\n    if dist.is_initialized():\n        dist.all_reduce(sums)\n",
                              "    sums = torch.stack([(x * mask).sum(), mask.sum()])\n", "tests/test_distributed.py"),
    "scale_reinforce_pp_per_rank": ("scale/grpo.py", "    if dist.is_initialized():\n        dist.all_reduce(square_sum)\n    return (x - mean) * torch.rsqrt(square_sum / sums[1] + eps)\n",
                                    "    return (x - mean) * torch.rsqrt(square_sum / sums[1] + eps)\n", "tests/test_grpo.py"),
    # scale/'s CUDA sampling loop, checked on the CPU with its steps run one by one
    "scale_graphed_position_off_by_one": ("scale/grpo.py", "    position = attention_mask.sum(1, keepdim=True) - 1  # positions count real tokens only",
                                          "    position = attention_mask.sum(1, keepdim=True)  # positions count real tokens only",
                                          "tests/test_gpu_path.py"),
    "scale_graphed_new_key_hidden": ("scale/grpo.py", "        keys[:, width + t] = True\n", "", "tests/test_gpu_path.py"),
    "scale_graphed_sliding_window_kept": ("scale/grpo.py", "    if any(layer.is_sliding for layer in cache.layers):\n",
                                          "    if False:\n", "tests/test_gpu_path.py"),
    "scale_draw_tokens_untempered": ("scale/grpo.py", "    z = logits.float() / temperature\n    return z.argmax(-1) if greedy",
                                     "    z = logits.float()\n    return z.argmax(-1) if greedy", "tests/test_gpu_path.py"),
    "scale_kv_cache_keys_as_wide_as_values": ("scale/grpo.py", "* length * (width + (2 if bf16 else width))",
                                              "* length * 2 * (2 if bf16 else width)", "tests/test_scaling.py"),
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
    # every flag or term that shapes a loss, ignored: the script's own test file must notice
    "grpo_ignores_loss_type": ("grpo.py", "policy_loss = aggregate_loss(surrogate, loss_mask[mb], args.loss_type,",
                               'policy_loss = aggregate_loss(surrogate, loss_mask[mb], "grpo",', "tests/test_grpo.py"),
    "grpo_ignores_rloo": ("grpo.py", "return rloo_advantages(rewards, num_generations)",
                          "return group_advantages(rewards, num_generations, scale_rewards)", "tests/test_grpo.py"),
    "grpo_ignores_reinforce_pp_baseline": ("grpo.py", 'reinforce_pp_advantages(rewards, num_generations, advantage == "reinforce_pp_baseline")',
                                           "reinforce_pp_advantages(rewards, num_generations, False)", "tests/test_grpo.py"),
    "grpo_ignores_sequence_level": ("grpo.py", "ratio = importance_ratio(logprobs, old_logprobs[mb], mask[mb], args.importance_sampling_level)",
                                    'ratio = importance_ratio(logprobs, old_logprobs[mb], mask[mb], "token")', "tests/test_grpo.py"),
    "grpo_ignores_cispo": ("grpo.py", '    if loss_type == "cispo":\n        return cispo_loss(', "    if False:\n        return cispo_loss(", "tests/test_grpo.py"),
    "grpo_ignores_epsilon_high": ("grpo.py", "epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high",
                                  "epsilon_high = args.epsilon", "tests/test_grpo.py"),
    "grpo_ignores_mask_truncated_completions": ("grpo.py", "loss_mask = mask * batch.has_stop.unsqueeze(1) if args.mask_truncated_completions else mask",
                                                "loss_mask = mask", "tests/test_grpo.py"),
    "grpo_no_missing_eos_penalty": ("grpo.py", "rewards = torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty))",
                                    "rewards = rewards", "tests/test_grpo.py"),
    "grpo_kl_ignores_beta": ("grpo.py", "kl_penalty = args.beta * aggregate_loss(new_k3", "kl_penalty = 0.04 * aggregate_loss(new_k3",
                             "tests/test_grpo.py"),
    "grpo_update_at_temperature_1": ("grpo.py", "logprobs, _ = policy_logprobs(policy, sequences[mb], attention_mask[mb], context_length,\n                                                  args.temperature)",
                                     "logprobs, _ = policy_logprobs(policy, sequences[mb], attention_mask[mb], context_length, 1.0)",
                                     "tests/test_grpo.py"),
    "rlhf_ppo_ignores_kl_coef": ("rlhf_ppo.py", "non_score = shaped_rewards(logprobs, ref_logprobs, scores, mask, kl_coef)",
                                 "non_score = shaped_rewards(logprobs, ref_logprobs, scores, mask, 0.0)", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_ignores_kl_target": ("rlhf_ppo.py", "if args.kl_target is not None:", "if False:", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_no_policy_clipping": ("rlhf_ppo.py", "advantages[mb], mask[mb], args.cliprange,", "advantages[mb], mask[mb], 1e9,",
                                    "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_no_value_clipping": ("rlhf_ppo.py", "returns[mb], mask[mb], args.cliprange_value, num_tokens)",
                                   "returns[mb], mask[mb], 1e9, num_tokens)", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_no_whitening": ("rlhf_ppo.py", "advantages = masked_whiten(advantages, mask)  # over the whole batch",
                              "advantages = advantages", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_update_at_temperature_1": ("rlhf_ppo.py", "new_logprobs, new_entropy = policy_logprobs(actor, sequences[mb], attention_mask[mb], context_length,\n                                                                args.temperature)",
                                         "new_logprobs, new_entropy = policy_logprobs(actor, sequences[mb], attention_mask[mb], context_length, 1.0)",
                                         "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_ignores_vf_coef": ("rlhf_ppo.py", "(pg_loss + args.vf_coef * vf_loss).backward()", "(pg_loss + vf_loss).backward()",
                                 "tests/test_rlhf_ppo.py"),
    "grpo_ignores_epsilon": ("grpo.py", "args.loss_type, args.epsilon, epsilon_high)",
                             "args.loss_type, 0.2, epsilon_high)", "tests/test_grpo.py"),
    "grpo_reinforce_pp_with_group_baseline": ("grpo.py", 'reinforce_pp_advantages(rewards, num_generations, advantage == "reinforce_pp_baseline")',
                                              "reinforce_pp_advantages(rewards, num_generations, True)", "tests/test_grpo.py"),
    "grpo_ignores_reward_weights": ("grpo.py", "weights = args.reward_weights or (1.0,) * (len(functions) + (args.reward_model_path is not None))",
                                    "weights = (1.0,) * (len(functions) + (args.reward_model_path is not None))", "tests/test_rewards.py"),
    "grpo_one_epoch": ("grpo.py", "        for epoch in range(args.ppo_epochs):", "        for epoch in range(1):", "tests/test_grpo.py"),
    "rlhf_ppo_ignores_reward_weights": ("rlhf_ppo.py", "weights = args.reward_weights or (1.0,) * (len(functions) + (reward_model_path is not None))",
                                        "weights = (1.0,) * (len(functions) + (reward_model_path is not None))", "tests/test_rewards.py"),
    "rlhf_ppo_ignores_kl_horizon": ("rlhf_ppo.py", "args.kl_target, args.kl_horizon, B)", "args.kl_target, 10_000, B)",
                                    "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_one_epoch": ("rlhf_ppo.py", "        for epoch in range(args.ppo_epochs):", "        for epoch in range(1):", "tests/test_rlhf_ppo.py"),
    "ppo_clip_ignores_clip_coef": ("ppo_clip.py", "pg_loss = clipped_policy_loss(ratio, mb_advantages, args.clip_coef)",
                                   "pg_loss = clipped_policy_loss(ratio, mb_advantages, 0.2)", "tests/test_ppo_clip.py"),
    "ppo_continuous_ignores_clip_coef": ("ppo_continuous.py", "pg_loss = clipped_policy_loss(ratio, mb_advantages, args.clip_coef)",
                                         "pg_loss = clipped_policy_loss(ratio, mb_advantages, 0.2)", "tests/test_ppo_continuous.py"),
    "ppo_kl_value_loss_ignores_clip_coef": ("ppo_kl.py", "b_returns[mb_inds], args.clip_coef, args.clip_vloss)",
                                            "b_returns[mb_inds], 0.2, args.clip_vloss)", "tests/test_ppo_kl.py"),
    # the schedule and the clip as main wires them (tests/test_real_models.py records every optimizer step)
    "sft_ignores_warmup": ("sft.py", "lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, \"cosine\")",
                           "lr = get_lr(step - 1, args.lr, 0, args.max_steps, \"cosine\")", "tests/test_real_models.py"),
    "sft_lr_not_given_to_the_optimizer": ("sft.py", "            group[\"lr\"] = lr\n", "            pass\n",
                                          "tests/test_real_models.py"),
    "reward_model_ignores_max_grad_norm": ("reward_model.py", "clip_grad_norm_(model.parameters(), args.max_grad_norm)",
                                           "clip_grad_norm_(model.parameters(), 1.0)", "tests/test_real_models.py"),
    "dpo_decays_by_cosine": ("dpo.py", "lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, \"linear\")",
                             "lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, \"cosine\")",
                             "tests/test_real_models.py"),
    "rlhf_ppo_never_anneals": ("rlhf_ppo.py", "if args.anneal_lr else args.lr", "if False else args.lr",
                               "tests/test_real_models.py"),
    "grpo_always_anneals": ("grpo.py", "if args.anneal_lr else args.lr", "if True else args.lr", "tests/test_real_models.py"),
    # a pass that does not sample and keeps a KV cache all the same (transformers' default): work and memory
    "sft_training_pass_keeps_a_kv_cache": ("sft.py", "use_cache=False).logits\n        logprobs = gather_logprobs(",
                                           ").logits\n        logprobs = gather_logprobs(", "tests/test_real_models.py"),
    "scale_head_logprobs_keeps_a_kv_cache": ("scale/rlhf_ppo.py", 'out = model(**{"use_cache": False, **inputs}).logits',
                                             "out = model(**inputs).logits", "tests/test_real_models.py"),
    "dpo_ignores_loss_type": ("dpo.py", "dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, args.loss_type,",
                              'dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, "sigmoid",', "tests/test_dpo.py"),
    "dpo_ignores_label_smoothing": ("dpo.py", "args.loss_type,\n                                  args.label_smoothing)",
                                    "args.loss_type,\n                                  0.0)", "tests/test_dpo.py"),
    "dpo_ignores_beta": ("dpo.py", "dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta,",
                         "dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.1,", "tests/test_dpo.py"),
    "reward_model_ignores_center_rewards": ("reward_model.py", "loss = bradley_terry_loss(r_c, r_r, margin, args.center_rewards_coefficient)",
                                            "loss = bradley_terry_loss(r_c, r_r, margin)", "tests/test_reward_model.py"),
    "reward_model_ignores_margin": ("reward_model.py", "loss = bradley_terry_loss(r_c, r_r, margin, args.center_rewards_coefficient)",
                                    "loss = bradley_terry_loss(r_c, r_r, None, args.center_rewards_coefficient)",
                                    "tests/test_reward_model.py"),
    "ppo_clip_ignores_ent_coef": ("ppo_clip.py", "loss = pg_loss - args.ent_coef * entropy_loss", "loss = pg_loss",
                                  "tests/test_ppo_clip.py"),
    "ppo_clip_ignores_vf_coef": ("ppo_clip.py", "+ v_loss * args.vf_coef  # eq. 9, negated", "+ v_loss  # eq. 9, negated",
                                 "tests/test_ppo_clip.py"),
    "ppo_clip_ignores_clip_vloss": ("ppo_clip.py", "args.clip_coef, args.clip_vloss)", "args.clip_coef, False)",
                                    "tests/test_ppo_clip.py"),
    "ppo_clip_ignores_target_kl": ("ppo_clip.py", "if args.target_kl is not None and approx_kl > args.target_kl:", "if False:",
                                   "tests/test_ppo_clip.py"),
    "ppo_kl_ignores_ent_coef": ("ppo_kl.py", "loss = pg_loss - args.ent_coef * entropy_loss", "loss = pg_loss",
                                "tests/test_ppo_kl.py"),
    "ppo_kl_ignores_clip_vloss": ("ppo_kl.py", "args.clip_coef, args.clip_vloss)", "args.clip_coef, False)", "tests/test_ppo_kl.py"),
    "ppo_kl_beta_not_adapted": ("ppo_kl.py", "beta = update_beta(beta, d, args.kl_target)", "beta = beta", "tests/test_ppo_kl.py"),
    "ppo_kl_no_advantage_normalization": ("ppo_kl.py", "if args.norm_adv:\n                    mb_advantages =",
                                          "if False:\n                    mb_advantages =", "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_ent_coef": ("ppo_continuous.py", "loss = pg_loss - args.ent_coef * entropy_loss", "loss = pg_loss",
                                        "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_vf_coef": ("ppo_continuous.py", "+ v_loss * args.vf_coef  # eq. 9, negated", "+ v_loss  # eq. 9, negated",
                                       "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_clip_vloss": ("ppo_continuous.py", "args.clip_coef, args.clip_vloss)", "args.clip_coef, False)",
                                          "tests/test_ppo_continuous.py"),
    "ppo_continuous_no_advantage_normalization": ("ppo_continuous.py", "if args.norm_adv:\n                    mb_advantages =",
                                                  "if False:\n                    mb_advantages =", "tests/test_ppo_continuous.py"),
    # every other flag that shapes a loss or an update: each break below ignores it (a constant, or a condition
    # fixed), and a test that sets it to another value fails
    "ppo_kl_ignores_vf_coef": ("ppo_kl.py", "+ v_loss * args.vf_coef  # eq. 9 with L^KLPEN",
        "+ v_loss  # eq. 9 with L^KLPEN", "tests/test_ppo_kl.py"),
    "ppo_kl_ignores_kl_beta": ("ppo_kl.py", "beta = args.kl_beta", "beta = 1.0", "tests/test_ppo_kl.py"),
    "ppo_kl_ignores_no_adaptive_kl": ("ppo_kl.py", "if args.adaptive_kl:", "if True:", "tests/test_ppo_kl.py"),
    "ppo_kl_never_bootstraps": ("ppo_kl.py", "if args.bootstrap_truncation and truncated.any():",
        "if False:", "tests/test_ppo_kl.py"),
    "ppo_clip_never_bootstraps": ("ppo_clip.py", "if args.bootstrap_truncation and truncated.any():",
        "if False:", "tests/test_ppo_clip.py"),
    "ppo_clip_always_bootstraps": ("ppo_clip.py", "if args.bootstrap_truncation and truncated.any():",
        "if truncated.any():", "tests/test_ppo_clip.py"),
    "ppo_continuous_never_bootstraps": ("ppo_continuous.py", "if args.bootstrap_truncation and truncated.any():",
        "if False:", "tests/test_ppo_continuous.py"),
    "ppo_clip_ignores_max_grad_norm": ("ppo_clip.py", "clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(agent.parameters(), 0.5)", "tests/test_ppo_clip.py"),
    "ppo_clip_one_epoch": ("ppo_clip.py", "for epoch in range(args.update_epochs):",
        "for epoch in range(1):", "tests/test_ppo_clip.py"),
    "ppo_clip_never_anneals": ("ppo_clip.py", "if args.anneal_lr:", "if False:", "tests/test_ppo_clip.py"),
    "ppo_continuous_ignores_target_kl": ("ppo_continuous.py", "if args.target_kl is not None and approx_kl > args.target_kl:",
        "if False:", "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_clip_reward": ("ppo_continuous.py", "scale_reward(reward, return_rms.var, args.clip_reward)",
        "scale_reward(reward, return_rms.var, 10.0)", "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_norm_obs": ("ppo_continuous.py", "        if not args.norm_obs:\n",
        "        if False:\n", "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_clip_obs": ("ppo_continuous.py", "return normalize(raw_obs, obs_rms.mean, obs_rms.var, args.clip_obs)",
        "return normalize(raw_obs, obs_rms.mean, obs_rms.var, 10.0)", "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_log_std_init": ("ppo_continuous.py", "args.hidden_size, args.log_std_init)",
        "args.hidden_size, -0.5)", "tests/test_ppo_continuous.py"),
    "rlhf_ppo_ignores_max_grad_norm": ("rlhf_ppo.py", "list(critic.parameters()),\n" + " " * 59 + "args.max_grad_norm)",
        "list(critic.parameters()),\n" + " " * 59 + "1.0)", "tests/test_real_models.py"),
    "grpo_ignores_max_grad_norm": ("grpo.py", "clip_grad_norm_(policy.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(policy.parameters(), 1.0)", "tests/test_real_models.py"),
    "grpo_ignores_max_sampling_rounds": ("grpo.py", "if short == 0 or len(rounds) == args.max_sampling_rounds:",
        "if short == 0 or len(rounds) == 3:", "tests/test_grpo.py"),
    "sft_ignores_max_grad_norm": ("sft.py", "clip_grad_norm_(model.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(model.parameters(), 1.0)", "tests/test_real_models.py"),
    "sft_ignores_weight_decay": ("sft.py", "weight_decay=args.weight_decay",
        "weight_decay=0.01", "tests/test_real_models.py"),
    "dpo_ignores_max_grad_norm": ("dpo.py", "clip_grad_norm_(policy.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(policy.parameters(), 1.0)", "tests/test_real_models.py"),
    "dpo_ignores_warmup": ("dpo.py", 'args.lr, args.warmup_steps, args.max_steps, "linear")',
        'args.lr, 30, args.max_steps, "linear")', "tests/test_real_models.py"),
    "reward_model_ignores_weight_decay": ("reward_model.py", "weight_decay=args.weight_decay",
        "weight_decay=0.01", "tests/test_real_models.py"),
    "reward_model_ignores_warmup": ("reward_model.py", 'args.lr, args.warmup_steps, args.max_steps, "linear")',
        'args.lr, 0, args.max_steps, "linear")', "tests/test_real_models.py"),
    "ppo_continuous_eval_ignores_clip_obs": ("ppo_continuous.py", "obs = normalize(obs, obs_rms.mean, obs_rms.var, args.clip_obs)",
        "obs = normalize(obs, obs_rms.mean, obs_rms.var, 10.0)", "tests/test_ppo_continuous.py"),
    "ppo_kl_ignores_max_grad_norm": ("ppo_kl.py", "clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(agent.parameters(), 0.5)", "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_max_grad_norm": ("ppo_continuous.py", "clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
        "clip_grad_norm_(agent.parameters(), 0.5)", "tests/test_ppo_continuous.py"),
    "ppo_kl_never_anneals": ("ppo_kl.py", "if args.anneal_lr:", "if False:", "tests/test_ppo_kl.py"),
    "ppo_continuous_never_anneals": ("ppo_continuous.py", "if args.anneal_lr:",
        "if False:", "tests/test_ppo_continuous.py"),
    "ppo_clip_always_anneals": ("ppo_clip.py", "if args.anneal_lr:", "if True:", "tests/test_ppo_clip.py"),
    "ppo_kl_loss_ignores_beta": ("ppo_kl.py", "pg_loss = kl_penalty_loss(ratio, mb_advantages, kl, beta)",
        "pg_loss = kl_penalty_loss(ratio, mb_advantages, kl, 1.0)", "tests/test_ppo_kl.py"),
    "ppo_kl_ignores_kl_target": ("ppo_kl.py", "update_beta(beta, d, args.kl_target)",
        "update_beta(beta, d, 0.01)", "tests/test_ppo_kl.py"),
    "ppo_kl_kl_reversed": ("ppo_kl.py", "kl = categorical_kl(b_old_logits[mb_inds], newlogits)",
        "kl = categorical_kl(newlogits, b_old_logits[mb_inds])", "tests/test_ppo_kl.py"),
    "rlhf_ppo_samples_at_temperature_1": ("rlhf_ppo.py", "stop_ids, args.response_length, args.temperature)\n            mask",
        "stop_ids, args.response_length)\n            mask", "tests/test_rlhf_ppo.py"),
    "grpo_samples_at_temperature_1": ("grpo.py", "args.response_length, args.temperature)\n        rewards, table, _, has_stop",
        "args.response_length)\n        rewards, table, _, has_stop", "tests/test_grpo.py"),
    "rlhf_ppo_rollout_logprobs_at_temperature_1": ("rlhf_ppo.py", "policy_logprobs(model, s, a, context_length, args.temperature)",
        "policy_logprobs(model, s, a, context_length, 1.0)", "tests/test_rlhf_ppo.py"),
    "grpo_rollout_logprobs_at_temperature_1": ("grpo.py", "policy_logprobs(model, s, a, context_length, args.temperature)",
        "policy_logprobs(model, s, a, context_length, 1.0)", "tests/test_grpo.py"),
    # scale/ samples through its own generate_in_chunks: the same flag ignored there, caught where the tiers part
    "scale_rlhf_ppo_samples_at_temperature_1": ("scale/rlhf_ppo.py", "args.response_length, args.temperature,\n"
        + " " * 16 + "args.generation_batch_size)\n            mask", "args.response_length, 1.0,\n" + " " * 16
        + "args.generation_batch_size)\n            mask", "tests/test_tiers.py"),
    "scale_grpo_samples_at_temperature_1": ("scale/grpo.py", "args.temperature, args.generation_batch_size)\n"
        + " " * 16 + "rounds.append", "1.0, args.generation_batch_size)\n" + " " * 16 + "rounds.append",
        "tests/test_tiers.py"),
    # the flags that set how the rollout is split into updates, and the group size, where the loop reads them
    "grpo_one_minibatch_per_epoch": ("grpo.py", "for start in range(0, B, args.mini_batch_size):",
        "for start in range(0, args.mini_batch_size, args.mini_batch_size):", "tests/test_grpo.py"),
    "rlhf_ppo_one_minibatch_per_epoch": ("rlhf_ppo.py", "for start in range(0, B, mini):",
        "for start in range(0, mini, mini):", "tests/test_rlhf_ppo.py"),
    "ppo_clip_one_minibatch_per_epoch": ("ppo_clip.py", "for start in range(0, batch_size, minibatch_size):",
        "for start in range(0, minibatch_size, minibatch_size):", "tests/test_ppo_clip.py"),
    "ppo_kl_one_minibatch_per_epoch": ("ppo_kl.py", "for start in range(0, batch_size, minibatch_size):",
        "for start in range(0, minibatch_size, minibatch_size):", "tests/test_ppo_kl.py"),
    "ppo_continuous_one_minibatch_per_epoch": ("ppo_continuous.py", "for start in range(0, batch_size, minibatch_size):",
        "for start in range(0, minibatch_size, minibatch_size):", "tests/test_ppo_continuous.py"),
    "grpo_advantages_over_the_batch": ("grpo.py", "return group_advantages(rewards, num_generations, scale_rewards)",
        "return group_advantages(rewards, len(rewards), scale_rewards)", "tests/test_grpo.py"),
    "grpo_rloo_over_the_batch": ("grpo.py", "return rloo_advantages(rewards, num_generations)",
        "return rloo_advantages(rewards, len(rewards))", "tests/test_grpo.py"),
    "grpo_never_samples_again": ("grpo.py", "        if not args.dynamic_sampling:\n            break",
        "        if True:\n            break", "tests/test_grpo.py"),
    "grpo_loss_divided_by_the_batch": ("grpo.py", "policy_loss = aggregate_loss(surrogate, loss_mask[mb], args.loss_type, args.mini_batch_size,",
        "policy_loss = aggregate_loss(surrogate, loss_mask[mb], args.loss_type, B,", "tests/test_grpo.py"),
    "grpo_kl_penalty_divided_by_the_batch": ("grpo.py", "args.mini_batch_size, num_tokens, args.response_length)",
        "B, num_tokens, args.response_length)", "tests/test_grpo.py"),
    "grpo_loss_counts_masked_tokens": ("grpo.py", "num_tokens = max(1.0, loss_mask[mb].sum().item())",
        "num_tokens = max(1.0, mask[mb].sum().item())", "tests/test_grpo.py"),
    # their scale/ lines, in other words there, caught where the tiers part
    "scale_grpo_one_minibatch_per_epoch": ("scale/grpo.py", "for start in range(0, per_rank, mini_per_rank):",
        "for start in range(0, mini_per_rank, mini_per_rank):", "tests/test_tiers.py"),
    "scale_rlhf_ppo_one_minibatch_per_epoch": ("scale/rlhf_ppo.py", "for start in range(0, per_rank, mini_per_rank):",
        "for start in range(0, mini_per_rank, mini_per_rank):", "tests/test_tiers.py"),
    "scale_grpo_loss_divided_by_the_batch": ("scale/grpo.py", "loss_mask[idx], args.loss_type, args.mini_batch_size,",
        "loss_mask[idx], args.loss_type, args.batch_size,", "tests/test_tiers.py"),
    "scale_grpo_loss_counts_masked_tokens": ("scale/grpo.py", 'all_reduce_sum({"tokens": loss_mask[mb].sum()}, device)',
        'all_reduce_sum({"tokens": mask[mb].sum()}, device)', "tests/test_tiers.py"),
    "ppo_continuous_always_scales_rewards": ("ppo_continuous.py", "            if args.norm_reward:\n",
        "            if True:\n", "tests/test_ppo_continuous.py"),
    "ppo_clip_ignores_learning_rate": ("ppo_clip.py", "lr=args.learning_rate, eps=1e-5", "lr=2.5e-4, eps=1e-5",
        "tests/test_ppo_clip.py"),
    # a fifth audit: the discount and the step size, each flag replaced where main uses it by its default
    "rlhf_ppo_ignores_gamma": ("rlhf_ppo.py", "masked_gae(rewards, values, mask, args.gamma, args.lam)",
        "masked_gae(rewards, values, mask, 1.0, args.lam)", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_ignores_lam": ("rlhf_ppo.py", "masked_gae(rewards, values, mask, args.gamma, args.lam)",
        "masked_gae(rewards, values, mask, args.gamma, 0.95)", "tests/test_rlhf_ppo.py"),
    "ppo_clip_ignores_gamma": ("ppo_clip.py", "args.gamma, args.gae_lambda)", "0.99, args.gae_lambda)",
        "tests/test_ppo_clip.py"),
    "ppo_clip_ignores_gae_lambda": ("ppo_clip.py", "args.gamma, args.gae_lambda)", "args.gamma, 0.95)",
        "tests/test_ppo_clip.py"),
    "ppo_kl_ignores_gamma": ("ppo_kl.py", "args.gamma, args.gae_lambda)", "0.99, args.gae_lambda)",
        "tests/test_ppo_kl.py"),
    "ppo_kl_ignores_gae_lambda": ("ppo_kl.py", "args.gamma, args.gae_lambda)", "args.gamma, 0.95)",
        "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_gamma": ("ppo_continuous.py", "args.gamma, args.gae_lambda)", "0.99, args.gae_lambda)",
        "tests/test_ppo_continuous.py"),
    "ppo_continuous_ignores_gae_lambda": ("ppo_continuous.py", "args.gamma, args.gae_lambda)", "args.gamma, 0.95)",
        "tests/test_ppo_continuous.py"),
    "ppo_continuous_reward_scaling_ignores_gamma": ("ppo_continuous.py",
        "discounted_returns = discounted_returns * args.gamma + reward",
        "discounted_returns = discounted_returns * 0.99 + reward", "tests/test_ppo_continuous.py"),
    "ppo_kl_ignores_learning_rate": ("ppo_kl.py", "lr=args.learning_rate, eps=1e-5", "lr=1e-3, eps=1e-5",
        "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_learning_rate": ("ppo_continuous.py", "lr=args.learning_rate, eps=1e-5",
        "lr=3e-4, eps=1e-5", "tests/test_ppo_continuous.py"),
    "ppo_clip_anneals_from_the_default_rate": ("ppo_clip.py", "/ num_iterations) * args.learning_rate",
        "/ num_iterations) * 2.5e-4", "tests/test_ppo_clip.py"),
    "rlhf_ppo_ignores_lr": ("rlhf_ppo.py",
        'lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr',
        'lr = get_lr(iteration - 1, 1.5e-4, 0, args.num_iterations, "linear") if args.anneal_lr else 1.5e-4',
        "tests/test_real_models.py"),
    "grpo_ignores_lr": ("grpo.py",
        'lr = get_lr(iteration - 1, args.lr, 0, args.num_iterations, "linear") if args.anneal_lr else args.lr',
        'lr = get_lr(iteration - 1, 1e-4, 0, args.num_iterations, "linear") if args.anneal_lr else 1e-4',
        "tests/test_real_models.py"),
    "dpo_ignores_lr": ("dpo.py", 'lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "linear")',
        'lr = get_lr(step - 1, 1e-4, args.warmup_steps, args.max_steps, "linear")', "tests/test_real_models.py"),
    "reward_model_ignores_lr": ("reward_model.py",
        'lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "linear")',
        'lr = get_lr(step - 1, 1e-3, args.warmup_steps, args.max_steps, "linear")', "tests/test_real_models.py"),
    "sft_ignores_lr": ("sft.py", 'lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "cosine")',
        'lr = get_lr(step - 1, 3e-3, args.warmup_steps, args.max_steps, "cosine")', "tests/test_real_models.py"),
    # and the rewards' own flags: the missing-EOS penalty's value, the format reward's pattern, the overlong L_max
    "rlhf_ppo_ignores_missing_eos_penalty": ("rlhf_ppo.py",
        "scores = torch.where(has_stop, scores, torch.full_like(scores, args.missing_eos_penalty))",
        "scores = torch.where(has_stop, scores, torch.full_like(scores, -3.0))", "tests/test_rlhf_ppo.py"),
    "grpo_ignores_missing_eos_penalty": ("grpo.py",
        "rewards = torch.where(has_stop, rewards, torch.full_like(rewards, args.missing_eos_penalty))",
        "rewards = torch.where(has_stop, rewards, torch.full_like(rewards, -1.0))", "tests/test_grpo.py"),
    "rlhf_ppo_ignores_format_pattern": ("rlhf_ppo.py",
        "load_reward_functions(args.reward_fn, BUILTIN_REWARDS, args.format_pattern)",
        "load_reward_functions(args.reward_fn, BUILTIN_REWARDS, r\"<answer>.*</answer>\")", "tests/test_rewards.py"),
    "grpo_ignores_format_pattern": ("grpo.py", "BUILTIN_REWARDS, args.format_pattern)",
        "BUILTIN_REWARDS, r\"<answer>.*</answer>\")", "tests/test_rewards.py"),
    "grpo_overlong_ignores_response_length": ("grpo.py",
        "soft_overlong_punishment(response_mask.sum(1), args.response_length,",
        "soft_overlong_punishment(response_mask.sum(1), 12,", "tests/test_grpo.py"),
    # a sixth audit: the shape of a batch, each flag replaced where main uses it by its default
    "sft_ignores_batch_size": ("sft.py", NEXT_BATCH, NEXT_BATCH.replace("args.batch_size", "64"),
        "tests/test_sft.py"),
    "reward_model_ignores_batch_size": ("reward_model.py", NEXT_BATCH, NEXT_BATCH.replace("args.batch_size", "64"),
        "tests/test_reward_model.py"),
    "dpo_ignores_batch_size": ("dpo.py", NEXT_BATCH, NEXT_BATCH.replace("args.batch_size", "64"),
        "tests/test_dpo.py"),
    "sft_ignores_max_length": ("sft.py", 'tokenize_examples(tokenizer, train_examples, stop_ids, args.max_length, "train")',
        'tokenize_examples(tokenizer, train_examples, stop_ids, 64, "train")', "tests/test_sft.py"),
    "reward_model_ignores_max_length": ("reward_model.py", "tokenize_pairs(tokenizer, rows, stop_ids, args.max_length, split)",
        "tokenize_pairs(tokenizer, rows, stop_ids, 64, split)", "tests/test_reward_model.py"),
    "dpo_ignores_max_length": ("dpo.py", "tokenize_pairs(tokenizer, rows, stop_ids, args.max_length, split)",
        "tokenize_pairs(tokenizer, rows, stop_ids, 64, split)", "tests/test_dpo.py"),
    "rlhf_ppo_ignores_batch_size": ("rlhf_ppo.py", "B, mini = args.batch_size, args.mini_batch_size",
        "B, mini = 128, args.mini_batch_size", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_ignores_mini_batch_size": ("rlhf_ppo.py", "B, mini = args.batch_size, args.mini_batch_size",
        "B, mini = args.batch_size, 32", "tests/test_rlhf_ppo.py"),
    "rlhf_ppo_ignores_max_prompt_length": ("rlhf_ppo.py",
        'tokenize_prompts(tokenizer, train_rows, args.max_prompt_length, "train")',
        'tokenize_prompts(tokenizer, train_rows, 64, "train")', "tests/test_rlhf_ppo.py"),
    "grpo_ignores_num_generations": ("grpo.py", "G, B = args.num_generations, args.batch_size",
        "G, B = 8, args.batch_size", "tests/test_grpo.py"),
    "grpo_ignores_batch_size": ("grpo.py", "G, B = args.num_generations, args.batch_size",
        "G, B = args.num_generations, 256", "tests/test_grpo.py"),
    "grpo_ignores_mini_batch_size": ("grpo.py",
        "for start in range(0, B, args.mini_batch_size):\n                mb = order[start : start + args.mini_batch_size]",
        "for start in range(0, B, 64):\n                mb = order[start : start + 64]", "tests/test_grpo.py"),
    "grpo_ignores_max_prompt_length": ("grpo.py",
        'tokenize_prompts(tokenizer, train_rows, args.max_prompt_length, "train")',
        'tokenize_prompts(tokenizer, train_rows, 64, "train")', "tests/test_grpo.py"),
    "ppo_clip_ignores_num_minibatches": ("ppo_clip.py", "minibatch_size = batch_size // args.num_minibatches",
        "minibatch_size = batch_size // 4", "tests/test_ppo_clip.py"),
    "ppo_kl_ignores_num_minibatches": ("ppo_kl.py", "minibatch_size = batch_size // args.num_minibatches",
        "minibatch_size = batch_size // 4", "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_num_minibatches": ("ppo_continuous.py", "minibatch_size = batch_size // args.num_minibatches",
        "minibatch_size = batch_size // 32", "tests/test_ppo_continuous.py"),
    "ppo_kl_ignores_update_epochs": ("ppo_kl.py", "for epoch in range(args.update_epochs):",
        "for epoch in range(10):", "tests/test_ppo_kl.py"),
    "ppo_continuous_ignores_update_epochs": ("ppo_continuous.py", "for epoch in range(args.update_epochs):",
        "for epoch in range(10):", "tests/test_ppo_continuous.py"),
    # their scale/ lines in other words there (each rank's share), caught where the tiers part
    "scale_dpo_ignores_batch_size": ("scale/dpo.py", SCALE_DPO_NEXT_BATCH,
        SCALE_DPO_NEXT_BATCH.replace("args.batch_size", "64"), "tests/test_tiers.py"),
    "scale_reward_model_ignores_max_length": ("scale/reward_model.py",
        'tokenize_pairs(tokenizer, train_rows, stop_ids, args.max_length, "train")',
        'tokenize_pairs(tokenizer, train_rows, stop_ids, 64, "train")', "tests/test_tiers.py"),
    "scale_rlhf_ppo_ignores_batch_size": ("scale/rlhf_ppo.py",
        "per_rank, mini_per_rank = args.batch_size // world_size, args.mini_batch_size // world_size",
        "per_rank, mini_per_rank = 128 // world_size, args.mini_batch_size // world_size", "tests/test_tiers.py"),
    "scale_rlhf_ppo_ignores_mini_batch_size": ("scale/rlhf_ppo.py",
        "per_rank, mini_per_rank = args.batch_size // world_size, args.mini_batch_size // world_size",
        "per_rank, mini_per_rank = args.batch_size // world_size, 32 // world_size", "tests/test_tiers.py"),
    "scale_grpo_ignores_num_generations": ("scale/grpo.py", "    G = args.num_generations\n", "    G = 8\n",
        "tests/test_tiers.py"),
    "scale_grpo_ignores_batch_size": ("scale/grpo.py", "prompts_per_rank = args.batch_size // G // world_size",
        "prompts_per_rank = 256 // G // world_size", "tests/test_tiers.py"),
    "scale_grpo_ignores_mini_batch_size": ("scale/grpo.py",
        "per_rank, mini_per_rank = prompts_per_rank * G, args.mini_batch_size // world_size",
        "per_rank, mini_per_rank = prompts_per_rank * G, 64 // world_size", "tests/test_tiers.py"),
    # A seventh audit: the flags that shape what is computed beyond the loss and the batch. --bf16 where main
    # turns autocast on (one text in the five top-level files; scale/'s own line, where under FSDP the mixed-precision
    # policy casts instead)
    "sft_ignores_bf16": ("sft.py", "enabled=args.bf16)  # noqa: E731", "enabled=False)  # noqa: E731",
        "tests/test_real_models.py"),
    "reward_model_ignores_bf16": ("reward_model.py", "enabled=args.bf16)  # noqa: E731", "enabled=False)  # noqa: E731",
        "tests/test_real_models.py"),
    "dpo_ignores_bf16": ("dpo.py", "enabled=args.bf16)  # noqa: E731", "enabled=False)  # noqa: E731",
        "tests/test_real_models.py"),
    "rlhf_ppo_ignores_bf16": ("rlhf_ppo.py", "enabled=args.bf16)  # noqa: E731", "enabled=False)  # noqa: E731",
        "tests/test_real_models.py"),
    "grpo_ignores_bf16": ("grpo.py", "enabled=args.bf16)  # noqa: E731", "enabled=False)  # noqa: E731",
        "tests/test_real_models.py"),
    "scale_sft_ignores_bf16": ("scale/sft.py", "enabled = args.bf16 and not (args.fsdp and dist.is_initialized())",
        "enabled = False", "tests/test_real_models.py"),
    "scale_reward_model_ignores_bf16": ("scale/reward_model.py", "enabled = args.bf16 and not (args.fsdp and dist.is_initialized())",
        "enabled = False", "tests/test_real_models.py"),
    "scale_dpo_ignores_bf16": ("scale/dpo.py", "enabled = args.bf16 and not (args.fsdp and dist.is_initialized())",
        "enabled = False", "tests/test_real_models.py"),
    "scale_rlhf_ppo_ignores_bf16": ("scale/rlhf_ppo.py", "enabled = args.bf16 and not (args.fsdp and dist.is_initialized())",
        "enabled = False", "tests/test_real_models.py"),
    "scale_grpo_ignores_bf16": ("scale/grpo.py", "enabled = args.bf16 and not (args.fsdp and dist.is_initialized())",
        "enabled = False", "tests/test_real_models.py"),
    # the size of the built-in task's training set (the same line in scale/)
    "sft_ignores_num_train_examples": ("sft.py", "load_data(args, demonstration_row, args.num_train_examples,",
        "load_data(args, demonstration_row, 100_000,", "tests/test_real_models.py"),
    "reward_model_ignores_num_train_pairs": ("reward_model.py", "load_data(args, preference_row, args.num_train_pairs,",
        "load_data(args, preference_row, 50_000,", "tests/test_real_models.py"),
    "dpo_ignores_num_train_pairs": ("dpo.py", "load_data(args, preference_row, args.num_train_pairs,",
        "load_data(args, preference_row, 20_000,", "tests/test_real_models.py"),
    # load_data, one text in all ten LM files: the split, the config, the built-in task's seed and eval size
    "sft_ignores_dataset_split": ("sft.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_split", '"train"'),
        "tests/test_real_models.py"),
    "sft_ignores_dataset_config": ("sft.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_config", "None"),
        "tests/test_real_models.py"),
    "sft_task_ignores_seed": ("sft.py", TASK_ROWS, TASK_ROWS.replace("task_rows(args.seed, \"train\"", "task_rows(1, \"train\""),
        "tests/test_real_models.py"),
    "sft_task_ignores_eval_size": ("sft.py", TASK_ROWS, TASK_ROWS.replace("args.eval_size", "512"),
        "tests/test_real_models.py"),
    "reward_model_ignores_dataset_split": ("reward_model.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_split", '"train"'),
        "tests/test_real_models.py"),
    "reward_model_ignores_dataset_config": ("reward_model.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_config", "None"),
        "tests/test_real_models.py"),
    "reward_model_task_ignores_seed": ("reward_model.py", TASK_ROWS, TASK_ROWS.replace("task_rows(args.seed, \"train\"", "task_rows(1, \"train\""),
        "tests/test_real_models.py"),
    "reward_model_task_ignores_eval_size": ("reward_model.py", TASK_ROWS, TASK_ROWS.replace("args.eval_size", "512"),
        "tests/test_real_models.py"),
    "dpo_ignores_dataset_split": ("dpo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_split", '"train"'),
        "tests/test_real_models.py"),
    "dpo_ignores_dataset_config": ("dpo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_config", "None"),
        "tests/test_real_models.py"),
    "dpo_task_ignores_seed": ("dpo.py", TASK_ROWS, TASK_ROWS.replace("task_rows(args.seed, \"train\"", "task_rows(1, \"train\""),
        "tests/test_real_models.py"),
    "dpo_task_ignores_eval_size": ("dpo.py", TASK_ROWS, TASK_ROWS.replace("args.eval_size", "512"),
        "tests/test_real_models.py"),
    "rlhf_ppo_ignores_dataset_split": ("rlhf_ppo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_split", '"train"'),
        "tests/test_real_models.py"),
    "rlhf_ppo_ignores_dataset_config": ("rlhf_ppo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_config", "None"),
        "tests/test_real_models.py"),
    "rlhf_ppo_task_ignores_seed": ("rlhf_ppo.py", TASK_ROWS, TASK_ROWS.replace("task_rows(args.seed, \"train\"", "task_rows(1, \"train\""),
        "tests/test_real_models.py"),
    "rlhf_ppo_task_ignores_eval_size": ("rlhf_ppo.py", TASK_ROWS, TASK_ROWS.replace("args.eval_size", "512"),
        "tests/test_real_models.py"),
    "grpo_ignores_dataset_split": ("grpo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_split", '"train"'),
        "tests/test_real_models.py"),
    "grpo_ignores_dataset_config": ("grpo.py", LOAD_ROWS, LOAD_ROWS.replace("args.dataset_config", "None"),
        "tests/test_real_models.py"),
    "grpo_task_ignores_seed": ("grpo.py", TASK_ROWS, TASK_ROWS.replace("task_rows(args.seed, \"train\"", "task_rows(1, \"train\""),
        "tests/test_real_models.py"),
    "grpo_task_ignores_eval_size": ("grpo.py", TASK_ROWS, TASK_ROWS.replace("args.eval_size", "512"),
        "tests/test_real_models.py"),
    # --seed where main seeds python's generator (the data order; the same text in scale/) and torch's
    "sft_data_order_ignores_seed": ("sft.py", "random.seed(args.seed)", "random.seed(1)", "tests/test_real_models.py"),
    "sft_torch_ignores_seed": ("sft.py", "torch.manual_seed(args.seed)", "torch.manual_seed(1)",
        "tests/test_real_models.py"),
    "scale_sft_torch_ignores_seed": ("scale/sft.py", "torch.manual_seed(args.seed + rank)", "torch.manual_seed(1 + rank)",
        "tests/test_real_models.py"),
    "reward_model_data_order_ignores_seed": ("reward_model.py", "random.seed(args.seed)", "random.seed(1)", "tests/test_real_models.py"),
    "reward_model_torch_ignores_seed": ("reward_model.py", "torch.manual_seed(args.seed)", "torch.manual_seed(1)",
        "tests/test_real_models.py"),
    "scale_reward_model_torch_ignores_seed": ("scale/reward_model.py", "torch.manual_seed(args.seed + rank)", "torch.manual_seed(1 + rank)",
        "tests/test_real_models.py"),
    "dpo_data_order_ignores_seed": ("dpo.py", "random.seed(args.seed)", "random.seed(1)", "tests/test_real_models.py"),
    "dpo_torch_ignores_seed": ("dpo.py", "torch.manual_seed(args.seed)", "torch.manual_seed(1)",
        "tests/test_real_models.py"),
    "scale_dpo_torch_ignores_seed": ("scale/dpo.py", "torch.manual_seed(args.seed + rank)", "torch.manual_seed(1 + rank)",
        "tests/test_real_models.py"),
    "rlhf_ppo_data_order_ignores_seed": ("rlhf_ppo.py", "random.seed(args.seed)", "random.seed(1)", "tests/test_real_models.py"),
    "rlhf_ppo_torch_ignores_seed": ("rlhf_ppo.py", "torch.manual_seed(args.seed)", "torch.manual_seed(1)",
        "tests/test_real_models.py"),
    "scale_rlhf_ppo_torch_ignores_seed": ("scale/rlhf_ppo.py", "torch.manual_seed(args.seed + rank)", "torch.manual_seed(1 + rank)",
        "tests/test_real_models.py"),
    "grpo_data_order_ignores_seed": ("grpo.py", "random.seed(args.seed)", "random.seed(1)", "tests/test_real_models.py"),
    "grpo_torch_ignores_seed": ("grpo.py", "torch.manual_seed(args.seed)", "torch.manual_seed(1)",
        "tests/test_real_models.py"),
    "scale_grpo_torch_ignores_seed": ("scale/grpo.py", "torch.manual_seed(args.seed + rank)", "torch.manual_seed(1 + rank)",
        "tests/test_real_models.py"),
    # the tiny model's size (the same text in scale/sft.py), and grpo.py's reward functions
    "sft_ignores_n_layer": ("sft.py", "n_layer=args.n_layer,", "n_layer=3,", "tests/test_sft.py"),
    "sft_ignores_n_embd": ("sft.py", "n_embd=args.n_embd,", "n_embd=128,", "tests/test_sft.py"),
    "sft_ignores_n_head": ("sft.py", "n_head=args.n_head,", "n_head=4,", "tests/test_sft.py"),
    "grpo_ignores_reward_fn": ("grpo.py", "functions = load_reward_functions(args.reward_fn or (",
        "functions = load_reward_functions(() or (", "tests/test_grpo.py"),
    # The eighth audit. The PPO scripts: --seed where main seeds numpy's generator (the rollout's actions), torch's
    # (the initial weights, the minibatch order), the envs' first reset and the evaluation episodes; --num-envs where
    # it counts the env steps (the x-axis of every scalar) and the iterations; --num-steps where the rollout stops;
    # --eval-episodes
    **{name: (f"{script}.py", old, new, f"tests/test_{script}.py")
       for script in ("ppo_clip", "ppo_kl", "ppo_continuous") for name, old, new in [
           (f"{script}_torch_ignores_seed", "torch.manual_seed(args.seed)", "torch.manual_seed(1)"),
           (f"{script}_numpy_ignores_seed", "np.random.seed(args.seed)", "np.random.seed(1)"),
           (f"{script}_envs_ignore_seed", "envs.reset(seed=args.seed + first_iteration - 1)",
            "envs.reset(seed=first_iteration)"),
           (f"{script}_evaluation_ignores_seed", "env.reset(seed=args.seed + 10_000 + episode)",
            "env.reset(seed=10_001 + episode)"),
           (f"{script}_global_step_ignores_num_envs", "global_step += args.num_envs", "global_step += 1"),
           (f"{script}_iterations_ignore_num_envs", "num_iterations = args.total_timesteps // batch_size",
            "num_iterations = args.total_timesteps // args.num_steps"),
           (f"{script}_rollout_one_step_short", "for step in range(args.num_steps):",
            "for step in range(args.num_steps - 1):"),
           (f"{script}_evaluation_ignores_eval_episodes", "for episode in range(args.eval_episodes):",
            "for episode in range(10):")]},
    # The LM scripts: --eval-every (the same text in scale/), --exp-name, the prompts drawn from --seed (the same
    # text in scale/), the evaluation's sampling flags (dpo.py's also in scale/dpo.py's words), --save-dtype,
    # --output-dir, and the --kl-coef that rlhf_ppo.py's KL controller starts from
    **{f"{script}_ignores_eval_every": (f"{script}.py", "% args.eval_every == 0", f"% {default} == 0",
                                        "tests/test_real_models.py")
       for script, default in (("sft", 500), ("reward_model", 200), ("dpo", 100), ("rlhf_ppo", 20), ("grpo", 20))},
    **{f"{script}_run_name_ignores_exp_name": (f"{script}.py", 'SummaryWriter(f"runs/{args.exp_name}__',
                                               'SummaryWriter(f"runs/run__', "tests/test_real_models.py")
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo")},
    **{f"{script}_prompts_ignore_seed": (f"{script}.py", "random.Random(args.seed)", "random.Random(1)",
                                         "tests/test_real_models.py") for script in ("rlhf_ppo", "grpo")},
    "sft_evaluation_ignores_max_new_tokens": ("sft.py", "stop_ids, args.max_new_tokens, greedy=greedy)",
        "stop_ids, 12, greedy=greedy)", "tests/test_real_models.py"),
    "dpo_evaluation_ignores_response_length": ("dpo.py", "tokenizer.pad_token_id, stop_ids, args.response_length,",
        "tokenizer.pad_token_id, stop_ids, 12,", "tests/test_real_models.py"),
    "dpo_evaluation_ignores_temperature": ("dpo.py", "stop_ids, args.response_length,\n                args.temperature)",
        "stop_ids, args.response_length,\n                1.0)", "tests/test_real_models.py"),
    "dpo_kl_ignores_temperature": ("dpo.py", "completion_logps(policy, sequences, attention_mask, labels, args.temperature)",
        "completion_logps(policy, sequences, attention_mask, labels)", "tests/test_dpo.py"),
    "dpo_evaluation_ignores_missing_eos_penalty": ("dpo.py", "args.missing_eos_penalty)[0])", "-3.0)[0])",
        "tests/test_dpo.py"),
    "scale_dpo_kl_ignores_temperature": ("scale/dpo.py",
        "response_logps(policy, sequences, attention_mask, context_length, args.temperature)",
        "response_logps(policy, sequences, attention_mask, context_length, 1.0)", "tests/test_dpo.py"),
    "scale_dpo_evaluation_ignores_missing_eos_penalty": ("scale/dpo.py", "args.missing_eos_penalty)[0])", "-3.0)[0])",
        "tests/test_dpo.py"),
    "rlhf_ppo_ignores_kl_coef_flag": ("rlhf_ppo.py", "    kl_coef = args.kl_coef\n", "    kl_coef = 1.0\n",
        "tests/test_rlhf_ppo.py"),
    "sft_ignores_save_dtype": ("sft.py", "return getattr(torch, args.save_dtype)", "return torch.float32",
        "tests/test_gpu_path.py"),
    "scale_sft_ignores_save_dtype": ("scale/sft.py", "return getattr(torch, args.save_dtype)", "return torch.float32",
        "tests/test_gpu_path.py"),
    "sft_ignores_output_dir": ("sft.py", "save_model(model, tokenizer, args, args.output_dir, save_dtype)",
        'save_model(model, tokenizer, args, "models/sft", save_dtype)', "tests/test_sft.py"),
    # The ninth audit: the flags only scale/ has. In each main: --system-prompt, --gradient-accumulation-steps,
    # --gradient-checkpointing, --save-every, and the evaluation's (--eval-batch-size) or the sampling's
    # (--generation-batch-size) batch size; in the texts the five share: LoRA's --lora-r, --lora-alpha,
    # --lora-dropout and --lora-target-modules, --merge-lora and --keep-checkpoints, broken in each copy
    **{f"scale_{script}_ignores_system_prompt": (f"scale/{script}.py", f"{rows}, {evals} = add_system_prompt({rows}, args), "
                                                f"add_system_prompt({evals}, args)", f"{rows}, {evals} = {rows}, {evals}",
                                                "tests/test_rewards.py")
       for script, rows, evals in (("sft", "train_examples", "eval_examples"), ("reward_model", "train_rows", "eval_rows"),
                                   ("dpo", "train_rows", "eval_rows"), ("rlhf_ppo", "train_rows", "eval_rows"),
                                   ("grpo", "train_rows", "eval_rows"))},
    **{f"scale_{script}_ignores_gradient_accumulation_steps": (f"scale/{script}.py",
        f"micro_size = {size} // args.gradient_accumulation_steps", f"micro_size = {size}", tests)
       for script, size, tests in (("sft", "per_rank", "tests/test_lm_memory.py"),
                                   ("reward_model", "per_rank", "tests/test_lm_memory.py"),
                                   ("dpo", "per_rank", "tests/test_lm_memory.py"),
                                   ("rlhf_ppo", "mini_per_rank", "tests/test_lm_memory.py"),
                                   ("grpo", "mini_per_rank", "tests/test_lm_memory.py"))},
    **{f"scale_{script}_ignores_gradient_checkpointing{which}": (f"scale/{script}.py",
        f"    if args.gradient_checkpointing:\n        {model}.activation_checkpointing_enable",
        f"    if False:\n        {model}.activation_checkpointing_enable", tests)
       for script, which, model, tests in (("sft", "", "raw_model", "tests/test_lm_memory.py"),
                                           ("reward_model", "", "raw_model", "tests/test_lm_memory.py"),
                                           ("dpo", "", "raw_policy", "tests/test_lm_memory.py"),
                                           ("rlhf_ppo", "", "raw_actor", "tests/test_lm_memory.py"),
                                           ("rlhf_ppo", "_critic", "raw_critic", "tests/test_lm_memory.py"),
                                           ("grpo", "", "raw_policy", "tests/test_lm_memory.py"))},
    **{f"scale_{script}_ignores_save_every": (f"scale/{script}.py", f"(args.save_every and {step} % args.save_every == 0)",
                                              "(False)", "tests/test_resume.py")
       for script, step in (("sft", "step"), ("reward_model", "step"), ("dpo", "step"), ("rlhf_ppo", "iteration"),
                            ("grpo", "iteration"))},
    **{f"scale_{script}_ignores_eval_batch_size": (f"scale/{script}.py", "eval_batch_size = args.eval_batch_size or micro_size",
                                                   "eval_batch_size = micro_size", tests)
       for script, tests in (("sft", "tests/test_scaling.py"), ("reward_model", "tests/test_lm_memory.py"),
                             ("dpo", "tests/test_lm_memory.py"))},
    "scale_rlhf_ppo_ignores_generation_batch_size": ("scale/rlhf_ppo.py",
        "                args.generation_batch_size)\n            mask = mask.float()",
        "                128)\n            mask = mask.float()", "tests/test_lm_memory.py"),
    "scale_grpo_ignores_generation_batch_size": ("scale/grpo.py",
        "args.temperature, args.generation_batch_size)\n                rounds.append",
        "args.temperature, 256)\n                rounds.append", "tests/test_lm_memory.py"),
    **{f"scale_{script}_{name}": (f"scale/{script}.py", old, new, tests)
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo") for name, old, new, tests in [
           ("lora_ignores_lora_r", "config = LoraConfig(r=args.lora_r,", "config = LoraConfig(r=8,", "tests/test_lora.py"),
           ("lora_ignores_lora_alpha", "lora_alpha=args.lora_alpha,", "lora_alpha=32.0,", "tests/test_lora.py"),
           ("lora_ignores_lora_dropout", "lora_dropout=args.lora_dropout,", "lora_dropout=0.0,", "tests/test_lora.py"),
           ("lora_ignores_target_modules", 'target_modules=list(args.lora_target_modules) or "all-linear"',
            'target_modules="all-linear"', "tests/test_lora.py"),
           ("ignores_merge_lora", "        if args.merge_lora:\n            model = model.merge_and_unload()",
            "        if False:\n            model = model.merge_and_unload()", "tests/test_lora.py"),
           ("ignores_keep_checkpoints", "for old in steps[: -args.keep_checkpoints]:", "for old in steps[:-2]:",
            "tests/test_resume.py")]},
    # The tenth audit: the flags no break had read yet. In the PPO scripts --exp-name in the run's name, --env-id
    # where the training envs and the evaluation env are made, --save-model, --load-model, --capture-video,
    # --save-every and --keep-checkpoints; in the LM scripts --save-dtype in each copy of save_dtype_of (sft.py's and
    # scale/sft.py's are the eighth audit's)
    **{f"{script}_{name}": (f"{script}.py", old, new, tests)
       for script, env in (("ppo_clip", "CartPole-v1"), ("ppo_kl", "CartPole-v1"), ("ppo_continuous", "HalfCheetah-v5"))
       for name, old, new, tests in [
           ("run_name_ignores_exp_name", 'run_name = f"{args.env_id}__{args.exp_name}__', 'run_name = f"{args.env_id}__run__',
            f"tests/test_{script}.py"),
           ("envs_ignore_env_id", "[lambda: gym.make(args.env_id) for _ in range(args.num_envs)]",
            f'[lambda: gym.make("{env}") for _ in range(args.num_envs)]', f"tests/test_{script}.py"),
           ("evaluation_ignores_env_id", 'env = gym.make(args.env_id, render_mode="rgb_array" if video_folder else None)',
            f'env = gym.make("{env}", render_mode="rgb_array" if video_folder else None)', f"tests/test_{script}.py"),
           ("ignores_save_model", "    if args.save_model:", "    if False:", f"tests/test_{script}.py"),
           ("ignores_load_model", "    if args.load_model is not None:\n        load_agent(",
            "    if False:\n        load_agent(", f"tests/test_{script}.py"),
           ("ignores_capture_video", 'f"videos/{run_name}" if args.capture_video else None', "None", f"tests/test_{script}.py"),
           ("ignores_save_every", "(args.save_every and iteration % args.save_every == 0)", "(False)",
            "tests/test_resume.py"),
           ("ignores_keep_checkpoints", "for old in found[: -args.keep_checkpoints]:", "for old in found[:-2]:",
            "tests/test_resume.py")]},
    **{f"{script.replace('/', '_')}_ignores_save_dtype": (f"{script}.py", "return getattr(torch, args.save_dtype)",
                                                          "return torch.float32", "tests/test_gpu_path.py")
       for script in ("reward_model", "dpo", "rlhf_ppo", "grpo", "scale/reward_model", "scale/dpo", "scale/rlhf_ppo",
                      "scale/grpo")},
    # --output-dir in each main the eighth audit did not break (sft.py's is above): the checkpoint goes to the default
    **{f"{script.replace('/', '_')}_ignores_output_dir": (f"{script}.py", "args.output_dir, save_dtype)",
                                                          f'"models/{os.path.basename(script)}", save_dtype)', tests)
       for script, tests in (("reward_model", "tests/test_reward_model.py"), ("dpo", "tests/test_dpo.py"),
                             ("rlhf_ppo", "tests/test_rlhf_ppo.py"), ("grpo", "tests/test_grpo.py"),
                             ("scale/sft", "tests/test_lm_memory.py"), ("scale/reward_model", "tests/test_lm_memory.py"),
                             ("scale/dpo", "tests/test_lm_memory.py"), ("scale/rlhf_ppo", "tests/test_lm_memory.py"),
                             ("scale/grpo", "tests/test_grpo.py"))},
    # An eleventh audit: the model paths where they shape what is trained or saved. Where main asks save_dtype_of
    # for the dtype of the checkpoint it started from (sft.py's and scale/sft.py's call, the eighth audit's
    # save-dtype test runs), and the critic that starts as the reward model
    **{f"{script.replace('/', '_')}_save_dtype_ignores_the_checkpoint": (f"{script}.py",
        f"save_dtype = save_dtype_of(args, {path})", "save_dtype = save_dtype_of(args, None)", "tests/test_real_models.py")
       for script, path in (("reward_model", "args.model_name_or_path"), ("dpo", "args.model_name_or_path"),
                            ("rlhf_ppo", "args.model_name_or_path"), ("grpo", "args.model_name_or_path"),
                            ("scale/reward_model", "args.model_name_or_path"), ("scale/dpo", "path"),
                            ("scale/rlhf_ppo", "args.model_name_or_path"), ("scale/grpo", "args.model_name_or_path"))},
    **{f"{script.replace('/', '_')}_critic_starts_from_the_sft_model": (f"{script}.py",
        "critic_path = reward_model_path or args.model_name_or_path", "critic_path = args.model_name_or_path", tests)
       for script, tests in (("rlhf_ppo", "tests/test_rlhf_ppo.py"), ("scale/rlhf_ppo", "tests/test_tiers.py"))},
    **{f"{script.replace('/', '_')}_evaluation_ignores_reward_model_path": (f"{script}.py",
        "has_reward = bool(args.reward_model_path) and os.path.isdir(args.reward_model_path)", "has_reward = False",
        "tests/test_dpo.py") for script in ("dpo", "scale/dpo")},
    # --fsdp where place_model shards (dpo's copy, the one tests/test_scaling.py runs on two ranks; the other four
    # are one text with it, tests/test_copies.py) and --resume where each scale/ main looks for the checkpoint
    "scale_dpo_ignores_fsdp": ("scale/dpo.py", "    if args.fsdp:\n        mesh = init_device_mesh",
                               "    if False:\n        mesh = init_device_mesh", "tests/test_scaling.py"),
    **{f"scale_{script}_ignores_resume": (f"scale/{script}.py", "    if args.resume is None:\n        return None",
                                          "    if True:\n        return None", "tests/test_resume.py")
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo")},
    # A twelfth audit: where each main stops on a NaN or inf loss or gradient norm before the optimizer steps
    **{f"{script.replace('/', '_')}_never_checks_the_loss": (f"{script}.py", call, "None", "tests/test_real_models.py")
       for script, call in (
           ("sft", "check_finite(step, loss=loss, grad_norm=grad_norm)"),
           ("reward_model", "check_finite(step, loss=loss, grad_norm=grad_norm)"),
           ("dpo", "check_finite(step, loss=loss, grad_norm=grad_norm)"),
           ("rlhf_ppo", "check_finite(iteration, loss=pg_loss + args.vf_coef * vf_loss, grad_norm=grad_norm)"),
           ("grpo", "check_finite(iteration, loss=policy_loss + kl_penalty, grad_norm=grad_norm)"),
           ("scale/sft", "check_finite(step, loss=batch_loss, grad_norm=grad_norm)"),
           ("scale/reward_model", "check_finite(step, loss=loss, grad_norm=grad_norm)"),
           ("scale/dpo", "check_finite(step, loss=loss, grad_norm=grad_norm)"),
           ("scale/rlhf_ppo", "check_finite(iteration, loss=pg_loss + args.vf_coef * vf_loss, grad_norm=grad_norm)"),
           ("scale/grpo", "check_finite(iteration, loss=policy_loss + kl_penalty, grad_norm=grad_norm)"))},
    # and where each main that takes a reward model refuses one whose tokenizer is another
    **{f"{script.replace('/', '_')}_never_checks_the_reward_tokenizer": (f"{script}.py", "        check_same_vocabulary(",
                                                                        "        (lambda *args: None)(", "tests/test_rewards.py")
       for script in ("dpo", "rlhf_ppo", "grpo", "scale/dpo", "scale/rlhf_ppo", "scale/grpo")},
    # A thirteenth audit: where each main checks its flags before any work, the model paths a main could fall back
    # from, and the RL scripts' --threads and --resume
    **{f"{script.replace('/', '_')}_skips_check_args": (f"{script}.py", "    check_args(args)\n", "    pass\n",
                                                        "tests/test_real_models.py")
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo",
                      "scale/sft", "scale/reward_model", "scale/dpo", "scale/rlhf_ppo", "scale/grpo")},
    "sft_ignores_model_name_or_path": ("sft.py", "    if args.model_name_or_path is not None:\n",
                                       "    if False:\n", "tests/test_sft.py"),
    "scale_sft_ignores_model_name_or_path": ("scale/sft.py", "    if args.model_name_or_path is None:  # the tiny GPT-2",
                                             "    if True:  # the tiny GPT-2", "tests/test_tiers.py"),
    **{f"{script.replace('/', '_')}_ignores_reward_model_path": (
        f"{script}.py", "reward_model_path = args.reward_model_path or (None if args.reward_fn else",
        "reward_model_path = (None if args.reward_fn else", "tests/test_rlhf_ppo.py")
       for script in ("rlhf_ppo", "scale/rlhf_ppo")},
    **{f"{script}_ignores_threads": (f"{script}.py", "torch.set_num_threads(args.threads)", "None",
                                     f"tests/test_{script}.py") for script in ("ppo_clip", "ppo_kl", "ppo_continuous")},
    **{f"{script}_ignores_resume": (f"{script}.py", "    if args.resume is None:\n        return None",
                                    "    if True:\n        return None", "tests/test_resume.py")
       for script in ("ppo_clip", "ppo_kl", "ppo_continuous")},
    # and the real-valued flags' ranges, checked in the same place
    **{f"{script.replace('/', '_')}_skips_the_number_ranges": (
        f"{script}.py", '        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):',
        "        if False:", "tests/test_real_models.py")
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo",
                      "scale/sft", "scale/reward_model", "scale/dpo", "scale/rlhf_ppo", "scale/grpo")},
    # and the flags held to an interval: rlhf_ppo's γ and λ, dpo's label smoothing
    **{f"{script.replace('/', '_')}_{what}_unchecked": (f"{script}.py", old, "    if False:", "tests/test_real_models.py")
       for what, scripts, old in (("gamma_lam", ("rlhf_ppo", "scale/rlhf_ppo"), "    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):"),
                                  ("label_smoothing", ("dpo", "scale/dpo"), "    if not 0 <= args.label_smoothing <= 0.5:"),
                                  ("missing_eos_penalty", ("dpo", "scale/dpo"), "    if not math.isfinite(args.missing_eos_penalty):"),
                                  ("rewards_finite", ("rlhf_ppo", "grpo", "scale/rlhf_ppo", "scale/grpo"),
                                   "    if not all(map(math.isfinite, (args.missing_eos_penalty, *args.reward_weights))):"))
       for script in scripts},
    # each reward term's mean over the completions it applies to, and only where it applies to some
    **{f"{script}_term_means_over_all": (f"{script}.py", "float((~table[:, k].isnan()).sum())", "len(table)",
                                         "tests/test_rewards.py") for script in ("grpo", "rlhf_ppo")},
    **{f"{script}_term_means_keep_empty_terms": (f"{script}.py", " if not table[:, k].isnan().all()}", "}",
                                                 "tests/test_rewards.py") for script in ("grpo", "rlhf_ppo")},
    # and scale/'s term_sums, which counts the completions each term applies to for the ranks to add up, and the
    # lines that log a term only where it applies to some (training, then evaluation)
    **{f"scale_{script}_term_sums_count_all": (f"scale/{script}.py", '{f"{prefix}{name}/n": (applies[:, k] * w).sum()',
                                               '{f"{prefix}{name}/n": w.sum()', "tests/test_tiers.py")
       for script in ("grpo", "rlhf_ppo")},
    **{f"scale_{script}_logs_{where}_terms_that_apply_to_none": (
        f"scale/{script}.py", f'if sums[f"rewards/{{name}}/n"] > 0:\n                tag = "{tag}"',
        f'if True:\n                tag = "{tag}"', "tests/test_tiers.py")
       for script in ("grpo", "rlhf_ppo") for where, tag in (("train", "objective/score"), ("eval", "eval/score"))},
    # A fourteenth audit: the plumbing's small helpers, each changed where the tests of its script did not look
    "sft_long_text_dropped": ("sft.py", "ids, labels = ids[:max_length], labels[:max_length]", "ids, labels = ids, labels",
                              "tests/test_sft.py"),
    "sft_check_finite_lets_inf_through": ("sft.py", "        if not math.isfinite(value):", "        if math.isnan(value):",
                                          "tests/test_real_models.py"),
    "sft_holds_out_half": ("sft.py", "n_eval = min(eval_size, len(rows) // 10)", "n_eval = min(eval_size, len(rows) // 2)",
                           "tests/test_real_models.py"),
    "dpo_eval_prompts_repeated": ("dpo.py", "dict.fromkeys(tuple(p) for p in eval_pair_prompts if p)",
                                  "[tuple(p) for p in eval_pair_prompts if p]", "tests/test_dpo.py"),
    "scale_rlhf_ppo_ignores_kl_coef_flag": ("scale/rlhf_ppo.py", "kl_coef = args.kl_coef", "kl_coef = 1.0",
                                            "tests/test_tiers.py"),
    "scale_dpo_eval_prompts_repeated": ("scale/dpo.py", "dict.fromkeys(tuple(p) for p in eval_pair_prompts if p)",
                                        "[tuple(p) for p in eval_pair_prompts if p]", "tests/test_dpo.py"),
    "grpo_samples_markdown_separator_short": ("grpo.py", '"|-" * (3 + len(names))', '"|-" * (2 + len(names))',
                                              "tests/test_rewards.py"),
    "sft_test_split_not_cut_to_eval_size": ("sft.py", 'return rows, list(data["test"])[:eval_size]',
                                            'return rows, list(data["test"])', "tests/test_real_models.py"),
    "dpo_gpt2_dropout_left_on": ("dpo.py", 'if ("dropout" in key or "pdrop" in key)', 'if ("dropout" in key)',
                                 "tests/test_real_models.py"),
    "scale_dpo_gpt2_dropout_left_on": ("scale/dpo.py", 'if ("dropout" in key or "pdrop" in key)', 'if ("dropout" in key)',
                                       "tests/test_real_models.py"),
    "dpo_frozen_models_keep_gradients": ("dpo.py", "        model.eval().requires_grad_(False)", "        model.eval()",
                                         "tests/test_real_models.py"),
    "grpo_keeps_empty_prompts": ("grpo.py", "if 0 < len(ids) <= max_prompt_length]", "if len(ids) <= max_prompt_length]",
                                 "tests/test_grpo.py"),
    "grpo_join_samples_unmasks_the_padding": ("grpo.py", "torch.cat([pad(s[1], width - s[2], 0) for s in samples])",
                                              "torch.cat([pad(s[1], width - s[2], 1) for s in samples])", "tests/test_grpo.py"),
    # scale/'s GPU path, in each copy (one text): the whole LM head recomputed anyway, its budget a quarter of the GPU
    # instead of an eighth, --compile's blocks compiled in the passes without gradients too, and the losses of a
    # step's micro-batches read as the first one's alone
    **{f"scale_{script}_recomputes_the_whole_head": (f"scale/{script}.py",
        "grad = not whole and torch.is_grad_enabled()", "grad = torch.is_grad_enabled()", "tests/test_scaling.py" if script == "dpo" else "tests/test_copies.py")
       for script in ("sft", "dpo", "rlhf_ppo", "grpo")},
    **{f"scale_{script}_whole_head_budget": (f"scale/{script}.py", "total_memory // 8 // 4", "total_memory // 4 // 4",
                                             "tests/test_scaling.py") for script in ("sft", "dpo", "rlhf_ppo", "grpo")},
    **{f"scale_{script}_compiles_passes_without_gradients": (f"scale/{script}.py",
        "(compiled if torch.is_grad_enabled() else type(block).forward)", "compiled", "tests/test_scaling.py")
       for script in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo")},
    # A new user's first hour (tests/test_first_hour.py): the thread count, the old flag name, the note before an
    # overwrite, own data (a malformed file, the lengths, the warmup, the samples), dpo.py's default reward model
    **{name: (script, old, new, "tests/test_first_hour.py") for name, script, old, new in [
        ("sft_threads_take_every_core", "sft.py", "return max(1, cores - 1)", "return cores"),
        ("sft_ignores_threads", "sft.py", "torch.set_num_threads(cpu_threads(args.threads))",
         "torch.set_num_threads(cpu_threads(None))"),
        ("scale_grpo_drops_the_old_flag_name", "scale/grpo.py", 'tyro.conf.arg(aliases=("--sft-model-path",))',
         "tyro.conf.arg(aliases=())"),
        ("sft_overwrites_silently", "sft.py", "    note_overwrite(args.output_dir)\n", ""),
        ("sft_leaves_json_to_datasets", "sft.py", "        check_json_file(name)\n", "        pass\n"),
        ("sft_length_error_without_lengths", "sft.py",
         'fits --max-length {max_length}: they have {min(lengths):,} to "', 'fits --max-length {max_length}: "'),
        ("sft_no_warmup_warning", "sft.py", '    check_warmup(args.warmup_steps, args.max_steps, "cosine")\n', ""),
        ("sft_no_samples_on_own_data", "sft.py", "    elif evals:  # own data", "    elif False:  # own data"),
        ("dpo_default_reward_model_stops", "dpo.py",
         "            if args.reward_model_path != Args.reward_model_path:\n                raise",
         "            if True:\n                raise")]},
    "scale_sft_logs_one_micro_batch_loss": ("scale/sft.py", "batch_loss = sum(torch.stack(losses).tolist())",
                                            "batch_loss = losses[0].item()", "tests/test_lm_memory.py"),
}


def run(name, keyword=None, workers=None, scale=False, first=False):
    """Apply one break in a copy of the repository, run its test file; returns (the failed tests, pytest's last line).
    With `scale`, the break goes to the top-level script's scale/ sibling, which carries the same line, and the
    test run is tests/test_tiers.py's cases of that script (the two tiers must stop computing the same thing),
    and, for a break that tests/test_real_models.py guards, that file's cases of the scale/ script too."""
    script, old, new, tests = BREAKS[name]
    if scale:
        tests = " ".join(["tests/test_tiers.py"] + [tests] * (tests == "tests/test_real_models.py"))
        keyword = keyword or f"{script[: -len('.py')]} and scale"  # test_tiers' test and the scale/ cases
        script = f"scale/{script}"
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
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests.split()]
        cmd += ["-n", str(workers)] if workers else []
        cmd += ["-x"] if first else []
        proc = subprocess.run(cmd + (["-k", keyword] if keyword else []), cwd=copy, capture_output=True, text=True)
    failed = re.findall(r"^FAILED \S+::(\S+)", proc.stdout, flags=re.M)
    return failed, (proc.stdout.strip().splitlines() or ["(no output)"])[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="breaks to run (all by default)")
    parser.add_argument("-k", dest="keyword", help="run only the tests pytest -k selects")
    parser.add_argument("-x", dest="first", action="store_true", help="stop each test run at its first failing "
                        "test: enough to show that a break is caught (the failing tests listed are then partial)")
    parser.add_argument("--list", action="store_true", help="list the breaks and exit")
    parser.add_argument("-n", dest="workers", type=int, help="run each test file on this many pytest-xdist workers")
    parser.add_argument("--scale", action="store_true", help="break the scale/ sibling of each top-level script "
                        "instead, against tests/test_tiers.py (and test_real_models.py's scale/ cases)")
    args = parser.parse_args()
    if args.list:
        for name, (script, old, new, tests) in BREAKS.items():
            print(f"{name}: {script}: {old.strip()!r} -> {new.strip()!r} ({tests})")
        return
    for name in args.names or BREAKS:
        if name not in BREAKS:
            sys.exit(f"error: no break {name!r}; --list shows them")
        failed, summary = run(name, args.keyword, args.workers, args.scale, args.first)
        tests = BREAKS[name][3]
        if args.scale:
            tests = "tests/test_tiers.py" + (" + the scale/ cases of " + tests) * (tests == "tests/test_real_models.py")
        print(f"| {name} | {tests} | {', '.join(failed) or 'NONE FAILS'} | {summary} |", flush=True)


if __name__ == "__main__":
    main()
