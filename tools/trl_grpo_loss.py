"""scale/grpo.py's 2026 variants (scale/'s alone) against TRL 1.16's GRPOTrainer on identical inputs (docs/grpo.md).
It runs in TRL's own virtual environment (docs/scaling.md says how to make it), never in this repo's:

    TRL_PYTHON tools/trl_grpo_loss.py

The loss: TRL's `GRPOTrainer._compute_loss`, called on a stand-in trainer whose forward pass returns the same
log-probs and entropies scale/grpo.py's loop gets (one process, one micro-batch per step, num_items_in_batch = the
batch's tokens): sapo, luspo (sequence-level ratio), vespo (with a token_truncate sampler correction), the entropy
bonus, the top-entropy quantile mask, and the adaptive coefficient over four steps, each with β = 0.04's k3 KL;
the loss and its gradient with respect to the log-probs (and the entropies, for the bonus). The advantages: TRL's
own lines of `_generate_and_score_completions` that compute them (read from the installed source and run as they
are) for scale_rewards="batch" and multi_objective_aggregation="normalize_then_sum", against
grpo.compute_advantages. Prints the largest relative difference per option; exits 1 if any exceeds 1e-5."""
import collections
import inspect
import math
import os
import sys
import textwrap
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trl.trainer.grpo_trainer import GRPOTrainer, nanstd  # noqa: E402

from scale import grpo  # noqa: E402

B, G, T = 6, 3, 5
torch.manual_seed(0)
MASK = (torch.arange(T) < torch.tensor([5, 3, 4, 1, 5, 2])[:, None]).float()  # completions of unequal lengths
OLD = -torch.rand(B, T) * 2 - 0.1
LOGPROBS = OLD + 0.3 * torch.randn(B, T)  # a step away from π_old: ratios 0.5 to 2
SAMPLER = OLD + 0.2 * torch.randn(B, T)
REF = OLD + 0.5 * torch.randn(B, T)
ENTROPY = torch.rand(B, T) * 2
ADVANTAGES = torch.tensor([1.2, -0.4, -0.8, 0.0, 2.0, -2.0])


def args_of(**options):
    """scale/grpo.py's Args with the options, as its loop passes them."""
    return grpo.Args(**{"beta": 0.04, "mini_batch_size": B, "response_length": T, **options})


def trl_inputs(vespo_correction=False):
    """The batch TRL's loss reads; with the sampler correction, TRL's token_truncate weights (C_max 3)."""
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": MASK, "advantages": ADVANTAGES,
              "old_per_token_logps": OLD, "ref_per_token_logps": REF, "num_items_in_batch": MASK.sum(),
              "sampling_per_token_logps": SAMPLER}
    if vespo_correction:
        inputs["importance_sampling_ratio"] = torch.exp((OLD - SAMPLER) * MASK).clamp(max=3.0)
    return inputs


def trl_trainer(config):
    """A stand-in GRPOTrainer with the attributes _compute_loss reads, TRL's defaults unless `config` says."""
    args = SimpleNamespace(**{"delta": None, "use_bias_correction_kl": False, "steps_per_generation": 1,
                              "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
                              "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "entropy_target": 0.2,
                              "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
                              **config.pop("args", {})})
    accelerator = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
                                  pad_across_processes=lambda x, dim, pad_index: x, num_processes=1, sync_gradients=True)
    trainer = SimpleNamespace(**{
        "loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.04, "importance_sampling_level": "token",
        "off_policy_mask_threshold": None, "top_entropy_quantile": 1.0, "use_vllm": False,
        "vllm_importance_sampling_correction": False, "max_completion_length": T, "entropy_coef": 0.0,
        "use_adaptive_entropy": False, "_last_world_entropy": math.inf, "_entropy_window_stats": None,
        "aux_loss_enabled": False, "current_gradient_accumulation_steps": 1, "args": args, "accelerator": accelerator,
        "model": SimpleNamespace(training=True), "_metrics": {"train": collections.defaultdict(list)},
        "get_gamma_weights": GRPOTrainer.get_gamma_weights, "get_off_policy_mask": GRPOTrainer.get_off_policy_mask,
        **config})
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(trainer, e, m, t)
    return trainer


def trl_loss(trainer, logprobs, entropy):
    """TRL's _compute_loss on the stand-in trainer, its forward pass returning these log-probs and entropies."""
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logprobs, entropy, None)
    return GRPOTrainer._compute_loss(trainer, None, trl_inputs(trainer.use_vllm))


def our_loss(logprobs, entropy, args, control):
    """scale/grpo.py's loop on one minibatch (one micro-batch): grpo_token_losses, aggregate_loss, kl_to_reference
    and the entropy bonus."""
    mb = torch.arange(B)
    batch = SimpleNamespace(mask=MASK, loss_mask=MASK, sampler_logprobs=SAMPLER)
    weights = (grpo.sampler_importance_weights(OLD, SAMPLER, MASK, "token_truncate", None, 3.0)
               if args.vllm_importance_sampling_correction else None)
    old = SimpleNamespace(logprobs=OLD, is_weights=weights)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    ratio = grpo.importance_ratio(logprobs, OLD, MASK, args.importance_sampling_level)
    per_token, counts = grpo.grpo_token_losses(ratio, logprobs, entropy, ADVANTAGES, batch, old, mb, epsilon_high, args)
    loss = grpo.aggregate_loss(per_token, MASK, args.loss_type, B, MASK.sum().item(), T)
    loss = loss + grpo.kl_to_reference(logprobs, REF, MASK, mb, MASK.sum().item(), T, args)
    return loss - control.bonus(entropy, MASK, counts)


def compare(name, trl_config, options, entropy_scales=(1.0,)):
    """(name, the largest relative difference) of TRL's and scale/grpo.py's losses and their gradients with respect to
    the log-probs and the entropies, over one step per entropy scale (the adaptive coefficient: the coefficient
    after each step too)."""
    trainer, args = trl_trainer(dict(trl_config)), args_of(**options)
    control, worst = grpo.EntropyControl(args), 0.0
    for scale in entropy_scales:
        ours_in, theirs_in = ([LOGPROBS.clone().requires_grad_(), (ENTROPY * scale).requires_grad_()] for _ in range(2))
        ours, theirs = our_loss(*ours_in, args, control), trl_loss(trainer, *theirs_in)
        worst = max(worst, abs(ours.item() - theirs.item()) / abs(theirs.item()))
        grads = (torch.autograd.grad(loss, x, allow_unused=True, materialize_grads=True)
                 for loss, x in ((ours, ours_in), (theirs, theirs_in)))
        for a, b in zip(*grads):
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item())
        worst = max(worst, abs(control.coef - trainer.entropy_coef) / max(trainer.entropy_coef, 1e-12))
    return name, worst


def main():
    results = [
        compare("sapo", {"loss_type": "sapo"}, {"loss_type": "sapo"}),
        compare("luspo (sequence-level ratio)", {"loss_type": "luspo", "importance_sampling_level": "sequence"},
                {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
        compare("vespo (token_truncate correction)", {"loss_type": "vespo", "use_vllm": True,
                                                      "vllm_importance_sampling_correction": True},
                {"loss_type": "vespo", "vllm_importance_sampling_correction": True,
                 "vllm_importance_sampling_mode": "token_truncate"}),
        compare("entropy_coef", {"entropy_coef": 0.3, "loss_type": "dapo"}, {"entropy_coef": 0.3, "loss_type": "dapo"}),
        compare("top_entropy_quantile", {"top_entropy_quantile": 0.3, "entropy_coef": 0.1},
                {"top_entropy_quantile": 0.3, "entropy_coef": 0.1}),
        # the entropy below, below, above and below the target: the bonus is off, on, on, off; c moves each step
        compare("use_adaptive_entropy (4 steps)", {"use_adaptive_entropy": True, "entropy_coef": 0.05,
                                                   "args": {"entropy_target": 1.0, "entropy_coef_delta": 0.02}},
                {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 1.0, "entropy_coef_delta": 0.02},
                (0.4, 0.4, 1.5, 0.4)),
        *advantages()]
    for name, diff in results:
        print(f"{name:<36} largest relative difference {diff:.1e}")
    worst = max(diff for _, diff in results)
    print(f"largest relative difference {worst:.1e}")
    sys.exit(0 if worst < 1e-5 else 1)


def advantages():
    """TRL's lines that compute the advantages, from the installed source, against grpo.compute_advantages."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    start = source.rindex("\n", 0, source.index('if self.multi_objective_aggregation == "sum_then_normalize":')) + 1
    end = source.index("advantages = torch.nan_to_num(advantages, nan=0.0)", start)
    block = textwrap.dedent(source[start:end] + "advantages = torch.nan_to_num(advantages, nan=0.0)\n")
    table = torch.tensor([[1.0, 0.2], [0.0, 0.9], [1.0, math.nan], [1.0, 0.4], [0.0, 0.3], [math.nan, math.nan]])
    weights = (1.0, 2.5)
    results = []
    for name, aggregation, scale in (("scale_rewards=batch", "sum_then_normalize", "batch"),
                                     ("normalize_then_sum (GDPO)", "normalize_then_sum", "group")):
        trainer = SimpleNamespace(multi_objective_aggregation=aggregation, scale_rewards=scale,
                                  reward_weights=torch.tensor(weights), reward_funcs=[None, None])
        scope = {"self": trainer, "rewards_per_func": table, "num_generations": G, "device": "cpu", "torch": torch,
                 "nanstd": nanstd, "unscorable_mask": torch.isnan(table).all(dim=1)}
        exec(block, scope)
        rewards = grpo.combine_rewards(table, weights)
        ours = grpo.compute_advantages(rewards, G, "grpo", scale, *((table, weights) if aggregation == "normalize_then_sum"
                                                                    else ()))
        theirs = scope["advantages"]
        results.append((name, ((ours - theirs).abs().max() / theirs.abs().max()).item()))
    return results


if __name__ == "__main__":
    main()
