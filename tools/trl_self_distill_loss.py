"""distill.py --self-distill against TRL 1.16's experimental SDPO/SDFT code on identical inputs (docs/distill.md). It
runs in TRL's own virtual environment (docs/scaling.md says how to make it), never in this repo's:

    TRL_PYTHON tools/trl_self_distill_loss.py

1. The per-token divergence: TRL's compute_full_logit_self_distillation_loss (its α is distill.py's β; TRL divides
   both models' logits by the temperature first, as its _forward_logits does) against distill.generalized_jsd, and
   TRL's compute_sampled_token_self_distillation_loss against distill.sampled_token_loss, with their gradients.
2. The reduction, which differs by design: TRL averages each completion's tokens, then the completions; distill.py
   averages every token of the batch. Both are printed on the same per-token values.
3. Which sibling teaches each completion under --teacher-context success: TRL's SuccessfulRolloutTeacherContextBuilder
   (dont_reprompt_on_self_success, threshold 1 on rewards of 0 or 1) on a stand-in trainer, against
   distill.success_demonstrations.
4. The EMA teacher: TRL's SyncRefModelCallback._sync_target_model against distill.ema_update.
Prints the largest differences and exits 1 if any exceeds 1e-5 (relative) or a choice differs."""
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trl.experimental.sdpo import loss_utils  # noqa: E402
from trl.experimental.sdpo.sdpo_trainer import SuccessfulRolloutTeacherContextBuilder  # noqa: E402
from trl.trainer.callbacks import SyncRefModelCallback  # noqa: E402

import distill  # noqa: E402


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def divergences():
    torch.manual_seed(0)
    B, T, V = 4, 7, 50
    mask = (torch.arange(T) < torch.tensor([7, 5, 3, 1])[:, None]).float()  # completions of unequal lengths
    worst = 0.0
    for beta in (0.0, 0.3, 0.5, 1.0):
        for temperature in (1.0, 0.7):
            student = (1.5 * torch.randn(B, T, V, dtype=torch.float64)).float().requires_grad_()
            teacher = 3.0 * torch.randn(B, T, V)
            ours = distill.generalized_jsd(student, teacher, beta, temperature)
            theirs = loss_utils.compute_full_logit_self_distillation_loss(student / temperature, teacher / temperature,
                                                                          distillation_alpha=beta)
            grads = [torch.autograd.grad((x * mask).sum(), student)[0] for x in (ours, theirs)]
            diff = max(relative(ours * mask, theirs * mask), relative(*grads))
            worst = max(worst, diff)
            token_mean = ((theirs * mask).sum() / mask.sum()).item()
            sequence_mean = ((theirs * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            print(f"full logits, beta {beta:<3} temperature {temperature}: per token and gradient {diff:.1e}; "
                  f"reduced: distill.py (token mean) {token_mean:.5f}, TRL (completion means, then their mean) "
                  f"{sequence_mean:.5f}")
    student = torch.randn(B, T, V, requires_grad=True)
    teacher, ids = 2.0 * torch.randn(B, T, V), torch.randint(V, (B, T))
    gather = lambda z: torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)  # noqa: E731
    ours = distill.sampled_token_loss(gather(student), gather(teacher))
    theirs = loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    grads = [torch.autograd.grad((x * mask).sum(), student)[0] for x in (ours, theirs)]
    diff = max(relative(ours * mask, theirs * mask), relative(*grads))
    print(f"sampled token: per token and gradient {diff:.1e}")
    return max(worst, diff)


class Tokens:
    """A stand-in tokenizer: a completion's ids are its text's characters."""
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if int(i) != 0)


def success_choices():
    """TRL's mining loop on one process, rewards 1 (success) or 0, G = 4, against distill.py's choice."""
    passed = [False, True, True, False, False, False, True, False, False, False, False, False]
    G = 4
    completions = torch.tensor([[ord("a") + i, ord("a") + i] for i in range(len(passed))])
    args = SimpleNamespace(success_reward_threshold=1.0, dont_reprompt_on_self_success=True,
                           environment_feedback_only_without_solution=False, use_successful_as_teacher=True,
                           include_environment_feedback=False, remove_thinking_from_demonstration=False,
                           solution_template="{successful_previous_attempt}", reprompt_template="{prompt}|{solution}",
                           max_reprompt_len=100)
    accelerator = SimpleNamespace(device="cpu", process_index=0, gather=lambda x: x,
                                  pad_across_processes=lambda x, dim, pad_index: x)
    trainer = SimpleNamespace(args=args, accelerator=accelerator, model=SimpleNamespace(training=True),
                              num_generations=G, _tokenizer=Tokens(), processing_class=Tokens(),
                              _tokenize_prompts_untruncated=lambda texts: [[ord(c) for c in t] for t in texts])
    out = SuccessfulRolloutTeacherContextBuilder(trainer).build(
        {"completion_ids": completions, "completion_mask": torch.ones_like(completions)},
        [f"p{i // G}" for i in range(len(passed))], torch.tensor([float(p) for p in passed]))
    theirs = []
    for row, keep in zip(out["teacher_input_ids"], out["self_distillation_mask"]):
        text = Tokens().decode(row[:-2])  # the teacher's prompt, without the completion's two ids
        theirs.append(ord(text.split("|")[1][0]) - ord("a") if keep else -1)
    ours = distill.success_demonstrations(passed, G)
    print(f"success: TRL's teaching sibling {theirs}, distill.py's {ours}")
    return theirs == ours


def ema():
    torch.manual_seed(1)
    teacher, student = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    ours = torch.nn.Linear(5, 3)
    ours.load_state_dict(teacher.state_dict())
    SyncRefModelCallback._sync_target_model(student, teacher, 0.05)
    distill.ema_update(ours, student, 0.05)
    diff = max(relative(a, b) for a, b in zip(ours.parameters(), teacher.parameters()))
    print(f"EMA teacher, rate 0.05: {diff:.1e}")
    return diff


def main():
    worst = max(divergences(), ema())
    same = success_choices()
    print(f"largest relative difference {worst:.1e}; the same teaching siblings: {same}")
    sys.exit(0 if worst < 1e-5 and same else 1)


if __name__ == "__main__":
    main()
