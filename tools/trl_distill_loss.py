"""distill.py's loss against TRL 1.16's DistillationTrainer loss on identical logits (docs/distill.md). It runs in
TRL's own virtual environment (docs/scaling.md says how to make it), never in this repo's:

    TRL_PYTHON tools/trl_distill_loss.py

TRL's loss (`_chunked_divergence_loss`, what DistillationTrainer._compute_loss returns) takes each model's hidden
states and LM head; given the logits as hidden states and the identity as the head, it computes on exactly these
logits. For β in {0, 0.25, 0.5, 0.9, 1} and temperatures 1 and 0.7, on random logits of unequal scales with padding
in the completion mask: distill.py's masked_mean(generalized_jsd(...)) against TRL's loss, and the gradients with
respect to the student's logits. Prints the largest differences and exits 1 if any exceeds 1e-5 (relative)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trl.trainer.distillation_trainer import _chunked_divergence_loss  # noqa: E402

import distill  # noqa: E402


def main():
    torch.manual_seed(0)
    B, T, V = 4, 7, 50
    mask = (torch.arange(T) < torch.tensor([7, 5, 3, 1])[:, None]).float()  # completions of unequal lengths
    worst = 0.0
    for beta in (0.0, 0.25, 0.5, 0.9, 1.0):
        for temperature in (1.0, 0.7):
            student = (1.5 * torch.randn(B, T, V, dtype=torch.float64)).float().requires_grad_()
            teacher = 3.0 * torch.randn(B, T, V)
            ours = distill.masked_mean(distill.generalized_jsd(student, teacher, beta, temperature), mask)
            ours_grad, = torch.autograd.grad(ours, student)
            hidden = student.detach().clone().requires_grad_()
            theirs, _, _ = _chunked_divergence_loss(hidden, teacher, torch.eye(V), torch.eye(V), mask, beta,
                                                    temperature=temperature)
            theirs_grad, = torch.autograd.grad(theirs, hidden)
            loss_diff = abs(ours.item() - theirs.item()) / abs(theirs.item())
            grad_diff = ((ours_grad - theirs_grad).abs().max() / theirs_grad.abs().max()).item()
            worst = max(worst, loss_diff, grad_diff)
            print(f"beta {beta:<4} temperature {temperature}: distill.py {ours.item():.7f}  TRL {theirs.item():.7f}  "
                  f"relative difference: loss {loss_diff:.1e}, gradient {grad_diff:.1e}")
    print(f"largest relative difference {worst:.1e}")
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
