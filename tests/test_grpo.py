"""grpo.py: the math against hand computations, and the script end to end (gold reward, reward model, a dataset
with targets, bad input)."""
import json
import math
import re

import pytest
import torch
from conftest import (
    CPU_FLOAT32,
    assert_one_line_error,
    assert_the_reference_stayed,
    one_line_exit,
    only_run_dir,
    read_scalars,
    reference_after_training,
    run_in_process,
    run_script,
    same_seed_scalars,
)
from lm_models import PositionLogits, by_hand

import grpo
from scale import grpo as scale_grpo


def test_group_advantages_scaled_and_not():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # two groups of G = 4, the second all equal
    # group 1: mean 0.5, deviations ±0.5; std with G − 1 = 3: sqrt(4 · 0.25 / 3) = 0.577350
    # Â = ±0.5 / (0.577350 + 1e-4) = ±0.865875; group 2: deviations 0, so Â = 0 (it teaches nothing)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(grpo.group_advantages(rewards, 4), torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    # Dr. GRPO, no std: the deviations themselves
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, scale_rewards=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # the groups are adjacent rows: G = 2 pairs (1, 0) (0, 1) (0.5, 0.5) (0.5, 0.5); std of (1, 0) = sqrt(0.5)
    b = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(grpo.group_advantages(rewards, 2), torch.tensor([b, -b, -b, b, 0, 0, 0, 0]))


def test_rloo_advantages():
    # G = 2: each against the other one: (1, 0.25) → 1 − 0.25 = 0.75 and 0.25 − 1 = −0.75; (0.3, 0.3) → 0, 0
    torch.testing.assert_close(grpo.rloo_advantages(torch.tensor([1.0, 0.25, 0.3, 0.3]), 2),
                               torch.tensor([0.75, -0.75, 0.0, 0.0]))
    # G = 3: (1, 0, 0.5): 1 − (0 + 0.5)/2 = 0.75; 0 − (1 + 0.5)/2 = −0.75; 0.5 − (1 + 0)/2 = 0
    torch.testing.assert_close(grpo.rloo_advantages(torch.tensor([1.0, 0.0, 0.5]), 3), torch.tensor([0.75, -0.75, 0.0]))



@pytest.mark.parametrize("module", [grpo, scale_grpo])
def test_compute_advantages_dispatches_each_variant(module):
    """Rewards 1, 0, 0.5 | 2, 2, 2 in groups of G = 3, by hand. rloo: 1 − 0.25 = 0.75, 0 − 0.75 = −0.75,
    0.5 − 0.5 = 0; the equal group 0. grpo: deviations 0.5, −0.5, 0 over std 0.5 (G − 1 = 2): ±0.5 / (0.5 + 1e-4);
    without scaling the deviations. reinforce_pp_baseline: r' = 0.5, −0.5, 0, 0, 0, 0, population std
    sqrt(0.5 / 6) = 0.288675: ±1.732051 (1e-8 in the variance); reinforce_pp: batch mean 7.5 / 6 = 1.25."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    a = 0.5 / (0.5 + 1e-4)
    cases = {("rloo", True): [0.75, -0.75, 0.0, 0.0, 0.0, 0.0], ("grpo", True): [a, -a, 0.0, 0.0, 0.0, 0.0],
             ("grpo", False): [0.5, -0.5, 0.0, 0.0, 0.0, 0.0],
             ("reinforce_pp_baseline", True): [1.732051, -1.732051, 0.0, 0.0, 0.0, 0.0]}
    for (advantage, scale), expected in cases.items():
        torch.testing.assert_close(module.compute_advantages(rewards, 3, advantage, scale), torch.tensor(expected))
    x = rewards - 1.25  # −0.25, −1.25, −0.75, 0.75 ×3; population variance (0.0625 + 1.5625 + 0.5625 + 3 · 0.5625) / 6
    torch.testing.assert_close(module.compute_advantages(rewards, 3, "reinforce_pp", True),
                               x / math.sqrt((0.0625 + 1.5625 + 0.5625 + 3 * 0.5625) / 6))


@pytest.mark.parametrize("module", [grpo, scale_grpo])
def test_token_losses_dispatch_cispo_and_the_clipped_surrogate(module):
    """ρ = 1.5, 0.5, 1.1, Â = 2, log π = log 0.6, log 0.2, log 0.9, ε_low 0.2, ε_high 0.3. The clipped surrogate:
    −min(3, 2.6) = −2.6, −min(1, 1.6) = −1, −min(2.2, 2.2) = −2.2 (every loss type but cispo); cispo with ε_high
    1.3, the cap itself (TRL's): weights 1.3, 0.5, 1.1 times −Â log π: −1.3·2·(−0.510826) = 1.328148, 1.609438,
    −1.1·2·(−0.105361) = 0.231793."""
    ratio, logprobs, advantages = torch.tensor([[1.5, 0.5, 1.1]]), torch.log(torch.tensor([[0.6, 0.2, 0.9]])), torch.tensor([2.0])
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        torch.testing.assert_close(module.token_losses(ratio, logprobs, advantages, loss_type, 0.2, 0.3),
                                   torch.tensor([[-2.6, -1.0, -2.2]]))
    torch.testing.assert_close(module.token_losses(ratio, logprobs, advantages, "cispo", 0.2, 1.3),
                               torch.tensor([[1.328148, 1.609438, 0.231793]]))

def test_clipped_surrogate_both_signs_and_clip_higher():
    ratios = torch.tensor([[1.5, 0.5, 1.1]])
    mask = torch.ones(1, 3)
    ratio = grpo.importance_ratio(ratios.log(), torch.zeros(1, 3), mask, "token")
    torch.testing.assert_close(ratio, ratios)
    # Â = 2: −min(ρÂ, clip(ρ, 0.8, 1.2)Â): 1.5 → −min(3, 2.4) = −2.4; 0.5 → −min(1, 1.6) = −1; 1.1 → −2.2
    loss = grpo.clipped_surrogate(ratio, torch.tensor([2.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-2.4, -1.0, -2.2]]))
    # Â = −1: 1.5 → −min(−1.5, −1.2) = 1.5; 0.5 → −min(−0.5, −0.8) = 0.8; 1.1 → −min(−1.1, −1.1) = 1.1
    loss = grpo.clipped_surrogate(ratio, torch.tensor([-1.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[1.5, 0.8, 1.1]]))
    # clip-higher, ε_high = 0.28, Â = 2: 1.5 → −min(3, 1.28 · 2 = 2.56) = −2.56; the lower bound is still 0.8
    loss = grpo.clipped_surrogate(ratio, torch.tensor([2.0]), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[-2.56, -1.0, -2.2]]))


def test_gspo_one_ratio_and_one_clip_per_completion():
    """GSPO's s_i = exp(mean_t log ρ_it) over the completion's tokens (Zheng et al. 2025, eq. 7). Completion 1: log ρ =
    0.2 and −0.4 on its 2 tokens (the third is padding, log ρ 5 ignored): s = e^−0.1 = 0.904837 at both tokens.
    Completion 2: one token, log ρ = 0.3: s = e^0.3 = 1.349859. With ε_low 0.05, ε_high 0.1 (band 0.95 to 1.1):
    Â = 2: −min(0.904837 · 2, 0.95 · 2) = −1.809675 for completion 1 (unclipped), −min(2.699718, 2.2) = −2.2 for 2;
    Â = −1: −min(−0.904837, −0.95) = 0.95 (clipped) and −min(−1.349859, −1.1) = 1.349859."""
    logprobs = torch.tensor([[0.2, -0.4, 5.0], [0.3, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ratio = grpo.importance_ratio(logprobs, torch.zeros(2, 3), mask, "sequence")
    torch.testing.assert_close(ratio * mask, torch.tensor([[0.904837, 0.904837, 0.0], [1.349859, 0.0, 0.0]]))
    loss = grpo.clipped_surrogate(ratio, torch.tensor([2.0, 2.0]), 0.05, 0.1) * mask
    torch.testing.assert_close(loss, torch.tensor([[-1.809675, -1.809675, 0.0], [-2.2, 0.0, 0.0]]))
    loss = grpo.clipped_surrogate(ratio, torch.tensor([-1.0, -1.0]), 0.05, 0.1) * mask
    torch.testing.assert_close(loss, torch.tensor([[0.95, 0.95, 0.0], [1.349859, 0.0, 0.0]]))
    # the gradient of completion 1's mean loss to each token's log-prob: −Â ∂s/∂log π_t = −2 · s / 2 = −0.904837,
    # the same for both tokens, none to the padding
    (grpo.clipped_surrogate(ratio, torch.tensor([2.0, 2.0]), 0.05, 0.1)[0, :2].mean()).backward()
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([-0.904837, -0.904837, 0.0]))


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_weight():
    """CISPO (MiniMax-M1): l_t = −sg(min(ρ_t, ε_high)) Â log π_t, the cap ε_high itself as TRL's (the paper's
    1 + ε_high^IS). ρ = 1.5, 0.5, 1.1 with ε_high 1.2: weights 1.2, 0.5, 1.1 (the old cap 1 + 1.2 would leave 1.5); Â = 2 and log π = log 0.6, log 0.2, log 0.9: l = −1.2·2·(−0.510826) = 1.225982,
    −0.5·2·(−1.609438) = 1.609438, −1.1·2·(−0.105361) = 0.231793. The gradient to log π_t is −w_t Â = −2.4, −1, −2.2:
    every token's, the clipped first one's too (the clipped surrogate gives it none), and nothing through the
    weight (not detached, it would add −w_t Â log π_t to the unclipped ones)."""
    old = torch.log(torch.tensor([[0.4, 0.4, 0.9 / 1.1]]))
    logprobs = torch.log(torch.tensor([[0.6, 0.2, 0.9]])).requires_grad_()
    ratio = grpo.importance_ratio(logprobs, old, torch.ones(1, 3), "token")
    torch.testing.assert_close(ratio.detach(), torch.tensor([[1.5, 0.5, 1.1]]))
    loss = grpo.cispo_loss(ratio, logprobs, torch.tensor([2.0]), 1.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([[1.225982, 1.609438, 0.231793]]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.4, -1.0, -2.2]]))
    # the batch's loss: the sum over its tokens over their number, as dapo's
    assert grpo.aggregate_loss(loss.detach(), torch.ones(1, 3), "cispo", 1, 3, 8).item() == pytest.approx(3.067213 / 3)


def test_reinforce_pp_normalizes_over_the_batch():
    """Rewards 1, 0 | 0, 0 in groups of 2. REINFORCE++: batch mean 0.25, deviations 0.75, −0.25 ×3, population
    variance (0.5625 + 3 · 0.0625) / 4 = 0.1875, std 0.433013: Â = 1.732051, −0.577350 ×3 (the all-zero group is
    compared with the batch). With the group baseline: r' = 0.5, −0.5, 0, 0, mean 0, variance 0.5 / 4 = 0.125,
    std 0.353553: Â = 1.414214, −1.414214, 0, 0 (a group of equal rewards teaches nothing)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(grpo.reinforce_pp_advantages(rewards, 2, False),
                               torch.tensor([1.732051, -0.577350, -0.577350, -0.577350]))
    torch.testing.assert_close(grpo.reinforce_pp_advantages(rewards, 2, True), torch.tensor([1.414214, -1.414214, 0.0, 0.0]))


def _batch_statistics_on_rank(rank, init_file, rewards, table, entropy, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    half = slice(rank * len(rewards) // 2, (rank + 1) * len(rewards) // 2)
    torch.save({"reinforce_pp": scale_grpo.reinforce_pp_advantages(rewards[half], 2, True),
                "batch": scale_grpo.compute_advantages(rewards[half], 2, "grpo", "batch"),
                "gdpo": scale_grpo.compute_advantages(rewards[half], 2, "grpo", "group", table[half], (1.0, 0.5)),
                "top_entropy": scale_grpo.high_entropy_mask(entropy[half], torch.ones_like(entropy[half]), 0.25)},
               f"{out_file}.{rank}")
    dist.destroy_process_group()


def test_the_batch_statistics_are_over_every_rank(tmp_path):
    """scale/grpo.py on two gloo processes, each with half of the groups (the halves with different spreads):
    together they give the one-process results of the whole batch (grpo.py's REINFORCE++; scale/grpo.py's own
    functions, on one process, for what the reference lacks), not each half's own: REINFORCE++'s normalization,
    --scale-rewards batch's std, GDPO's batch normalization, and the 80/20 rule's quantile (the high entropies all on
    rank 1); REINFORCE++ on one process, the same bitwise in both tiers."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0, -1.0, 0.2, 0.0])
    table = torch.stack([rewards, torch.tensor([0.1, 0.9, 0.0, 0.0, 5.0, 1.0, 0.4, 0.2])], 1)
    entropy = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8], [2.0, 2.1], [2.2, 2.3], [2.4, 2.5], [2.6, 2.7]])
    torch.multiprocessing.spawn(_batch_statistics_on_rank, nprocs=2,
                                args=(str(tmp_path / "init"), rewards, table, entropy, str(tmp_path / "out")))
    parts = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    ones = torch.ones_like(entropy)
    expected = {"reinforce_pp": grpo.reinforce_pp_advantages(rewards, 2, True),
                "batch": scale_grpo.compute_advantages(rewards, 2, "grpo", "batch"),
                "gdpo": scale_grpo.compute_advantages(rewards, 2, "grpo", "group", table, (1.0, 0.5)),
                "top_entropy": scale_grpo.high_entropy_mask(entropy, ones, 0.25)}
    for name, value in expected.items():
        together = torch.cat([part[name] for part in parts])
        torch.testing.assert_close(together, value, atol=1e-6, rtol=0, msg=name)
        alone = {"reinforce_pp": lambda: grpo.reinforce_pp_advantages(rewards[:4], 2, True),
                 "batch": lambda: scale_grpo.compute_advantages(rewards[:4], 2, "grpo", "batch"),
                 "gdpo": lambda: scale_grpo.compute_advantages(rewards[:4], 2, "grpo", "group", table[:4], (1.0, 0.5)),
                 "top_entropy": lambda: scale_grpo.high_entropy_mask(entropy[:4], ones[:4], 0.25)}[name]()
        assert (together[:4].float() - alone.float()).abs().max() > 0.1, name  # rank 0's half alone is another result
    for baseline in (False, True):
        assert torch.equal(scale_grpo.reinforce_pp_advantages(rewards, 2, baseline),
                           grpo.reinforce_pp_advantages(rewards, 2, baseline))


def test_tokenize_prompts_drops_the_empty_and_the_too_long(capsys):
    """tokenize_prompts (grpo.py and rlhf_ppo.py): a prompt longer than --max-prompt-length is dropped, and so is an
    empty one, which would leave a row with nothing to attend to when its completion starts; the rows kept keep their
    other columns, and the count dropped is printed."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    rows = [{"prompt": "sort 21:", "target": "12"}, {"prompt": "", "target": ""}, {"prompt": "sort 4321:", "target": "1234"}]
    kept, ids = grpo.tokenize_prompts(tokenizer, rows, 8, "train")
    assert kept == rows[:1] and ids == [grpo.encode_prompt(tokenizer, "sort 21:")]
    assert "train: dropped 2 of 3 prompts longer than --max-prompt-length 8 (or empty; the longest: 10 tokens)" in \
        capsys.readouterr().out


def test_join_samples_by_hand():
    """Dynamic sampling's rounds as one batch: prompts of different widths left-padded to the widest (the padding
    masked out), responses right-padded to the longest (outside the response mask), the context length the widest."""
    one = (torch.tensor([[7, 8, 9]]), torch.tensor([[1, 1, 1]]), 2, torch.tensor([[1]]), torch.tensor([[-0.5]]))
    two = (torch.tensor([[0, 6, 7, 3, 4]]), torch.tensor([[0, 1, 1, 1, 1]]), 3, torch.tensor([[1, 1]]),
           torch.tensor([[-0.25, -2.0]]))  # one: prompt 7 8, response 9 (its sampler's log-prob −0.5)
    sequences, attention_mask, context_length, response_mask, sampler_logprobs = grpo.join_samples([one, two], 0)
    assert sequences.tolist() == [[0, 7, 8, 9, 0], [0, 6, 7, 3, 4]]
    assert attention_mask.tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert context_length == 3 and response_mask.tolist() == [[1, 0], [1, 1]]
    assert sampler_logprobs.tolist() == [[-0.5, 0.0], [-0.25, -2.0]]


def test_informative_groups_and_soft_overlong_punishment():
    """DAPO: a group is kept when its rewards are not all equal (eq. 11); the soft overlong punishment (eq. 13) with
    L_max = 20, L_cache = 4 is 0 up to 16 tokens, then (16 − |o|) / 4, and −1 at and past the limit."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, -1.0, -1.0, -1.0, 0.5, 0.5, 0.5001])
    assert grpo.informative_groups(rewards, 3).tolist() == [False, True, False, True]
    assert grpo.informative_groups(rewards, 6).tolist() == [True, True]
    lengths = torch.tensor([3.0, 16.0, 17.0, 19.0, 20.0, 21.0])
    assert grpo.soft_overlong_punishment(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert grpo.soft_overlong_punishment(lengths, 20, 1).tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, -1.0]


def test_kl_k3():
    # log π = log 0.5, log π_ref = log 0.25: log r = log 0.5; k3 = r − 1 − log r = 0.5 − 1 + 0.693147 = 0.193147
    _, k3 = grpo.kl_estimators(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), torch.ones(1, 1))
    assert k3.item() == pytest.approx(0.193147, abs=1e-6)


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", (6 / 3 + 4 / 1) / 2),  # per completion (1+2+3)/3 = 2 and 4/1 = 4, then their mean: 3
    ("dapo", (6 + 4) / 4),  # all 4 valid tokens: 10 / 4 = 2.5
    ("dr_grpo", (6 + 4) / (2 * 6)),  # a constant, B · L_max = 2 · 6 (L_max, not the padded width 5): 0.8333
])
def test_loss_normalizations_on_a_padded_batch(loss_type, expected):
    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0, 100.0], [4.0, 100.0, 100.0, 100.0, 100.0]])  # 100: padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    total = grpo.aggregate_loss(per_token, mask, loss_type, 2, 4, 6)
    assert total.item() == pytest.approx(expected)
    # split into two micro-batches of one completion, with the whole minibatch's normalizers: the parts add up
    parts = [grpo.aggregate_loss(per_token[i : i + 1], mask[i : i + 1], loss_type, 2, 4, 6) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(expected)


def read_run(cwd, name):
    return read_scalars(str(next((cwd / "runs").glob(f"{name}__*"))))


def test_grpo_smoke_gold_reward_first_ratio_is_exactly_one(tiny_checkpoints, tmp_path):
    """Built-in task, gold reward: runs, logs the tags, the ratio is exactly 1 on the first minibatch of each
    batch, the checkpoint loads; two models in memory."""
    models = tiny_checkpoints["cwd"] / "models"
    proc = run_script("grpo.py", "--model-name-or-path", str(models / "sft"), "--num-iterations", "2", "--batch-size", "16",
                      "--num-generations", "4", "--mini-batch-size", "8",
                      "--eval-size", "8", "--eval-every", "1", cwd=tmp_path)
    assert "2 model(s) in memory" in proc.stdout
    logs = read_run(tmp_path, "grpo")
    assert [v for _, v in logs["policy/first_ratio_max_error"]] == [0.0, 0.0]
    for tag in ("eval/gold_accuracy", "eval/gold_score", "eval/kl", "objective/reward", "objective/reward_std",
                "objective/zero_std_fraction", "policy/clipfrac", "policy/clipfrac_low", "policy/clipfrac_high",
                "objective/completion_length", "losses/policy_loss"):
        assert tag in logs, tag
    assert [step for step, _ in logs["eval/gold_accuracy"]] == [0, 1, 2]
    assert logs["eval/kl"][0][1] == 0.0  # before any update the policy is the reference
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "grpo")


def test_grpo_reward_model_and_rloo_without_reference(tiny_checkpoints, tmp_path):
    """--reward-model-path --advantage rloo --beta 0: the reward model scores (eval/score), no reference is loaded
    (and no eval/kl is logged)."""
    models = tiny_checkpoints["cwd"] / "models"
    proc = run_script("grpo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path",
                      str(models / "reward_model"), "--advantage", "rloo", "--beta", "0", "--loss-type", "dapo",
                      "--num-iterations", "2", "--batch-size", "8", "--num-generations", "2", "--mini-batch-size", "8",
                      "--eval-size", "8", cwd=tmp_path)
    assert "2 model(s) in memory: the policy, the reward model" in proc.stdout
    logs = read_run(tmp_path, "grpo")
    assert "eval/score" in logs and "eval/kl" not in logs and "objective/kl" not in logs
    assert [v for _, v in logs["policy/first_ratio_max_error"]] == [0.0, 0.0]


def test_grpo_on_a_dataset_with_targets(tiny_checkpoints, tmp_path, monkeypatch):
    """A .jsonl of prompts with a `target` column and the exact-match reward; the reward is one of 0, 1 and the
    missing-EOS penalty, so its mean lies within [penalty, 1]; the built-in task's gold metrics are not logged.
    --max-prompt-length 10 drops the two thirds of the prompts that are 12 or 15 tokens long: none is sampled from
    (a script that reads the flag at its default, 64, samples them: seen, 5 of its 8 training prompts)."""
    lengths, real = [], grpo.generate

    def spy(model, prompt_ids, *args, **kwargs):
        lengths.extend(len(p) for p in prompt_ids)
        return real(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(grpo, "generate", spy)
    # 9, 12 or 15 bytes, one token each (the tiny model's tokenizer is byte-level)
    rows = [{"prompt": f"sort {f'{a}{b}{c}' * k}:", "target": "".join(sorted(f"{a}{b}{c}" * k))}
            for a in range(3) for b in range(3) for c in range(3) for k in (1, 2, 3)]
    assert sorted({len(r["prompt"].encode()) for r in rows}) == [9, 12, 15]
    (tmp_path / "math.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("grpo.py", "--model-name-or-path", str(models / "sft"), "--dataset-name", "math.jsonl", "--reward-fn",
                   "exact_match", "--num-iterations", "2", "--batch-size", "16", "--num-generations", "4",
                   "--mini-batch-size", "8", "--eval-size", "4", "--max-prompt-length", "10", cwd=tmp_path)
    assert len(lengths) >= 32 and max(lengths) <= 10, lengths  # two rollouts of 16 completions, and the evaluations
    logs = read_run(tmp_path, "grpo")
    assert all(-1.0 <= v <= 1.0 for _, v in logs["objective/reward"])
    assert "eval/rewards/exact_match" in logs and "eval/gold_accuracy" not in logs


def test_a_completion_without_a_stop_token_gets_the_penalty_not_its_gold_score(tiny_checkpoints, tmp_path):
    """One token per completion: mostly a digit, which does not end the completion. Its gold score would be
    > 0 (one digit of the 4 to 8 of the answer); its reward is the penalty, exactly. Where the one token is
    the EOS (now and then: seen on CUDA), the completion is empty and its gold score 0, so a rollout's mean
    reward is exactly penalty × (1 − stop fraction)."""
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("grpo.py", "--model-name-or-path", str(models / "sft"), "--response-length", "1", "--missing-eos-penalty",
                   "-0.7", "--num-iterations", "2", "--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "8",
                   "--eval-size", "4", cwd=tmp_path)
    logs = read_run(tmp_path, "grpo")
    stops = [v for _, v in logs["objective/stop_fraction"]]
    assert len(stops) == 2 and all(s < 0.5 for s in stops)
    assert [v for _, v in logs["objective/reward"]] == pytest.approx([-0.7 * (1 - s) for s in stops])


SCALE_ONLY = "scale/grpo.py"  # the variants scale/grpo.py alone has: its checks


@pytest.mark.parametrize("flags,words", [
    (["--num-generations", "1"], ["--num-generations 1", "at least 2"]),
    (["--batch-size", "20", "--num-generations", "8"], ["--batch-size 20", "groups of --num-generations 8"]),
    (["--loss-type", "mean"], ["--loss-type 'mean'", "grpo, dapo, dr_grpo, cispo"]),
    (["--loss-type", "cispo", "--importance-sampling-level", "sequence"], ["cispo", "--importance-sampling-level token"]),
    (["--importance-sampling-level", "group"], ["--importance-sampling-level 'group'", "token, sequence"]),
    (["--advantage", "reinforce_pp", "--scale-rewards", "none"], ["--scale-rewards none", "--advantage reinforce_pp"]),
    (["--reward-model-path", "models/nope"], ["models/nope", "python reward_model.py"]),
    (["--dynamic-sampling", "--max-sampling-rounds", "0"], ["--max-sampling-rounds 0", "at least 1"]),
    (["--soft-overlong-cache", "12"], ["--soft-overlong-cache 12", "--response-length 12", "to 11"]),
    ([SCALE_ONLY, "--advantage", "maxrl"], ["--advantage maxrl", "--missing-eos-penalty 0", "-1.0"]),
    ([SCALE_ONLY, "--top-entropy-quantile", "1.5"], ["--top-entropy-quantile 1.5", "[0, 1]"]),
    ([SCALE_ONLY, "--loss-type", "vespo", "--importance-sampling-level", "sequence"], ["vespo",
                                                                                      "--importance-sampling-level token"]),
    ([SCALE_ONLY, "--multi-objective-aggregation", "normalize_then_sum", "--advantage", "rloo"], ["normalize_then_sum",
                                                                                                  "--advantage grpo"]),
    ([SCALE_ONLY, "--dppo-divergence", "tv"], ["--dppo-divergence 'tv'", "binary_tv, binary_kl"]),
])
def test_bad_input_is_one_line(tiny_checkpoints, tmp_path, flags, words):
    models = tiny_checkpoints["cwd"] / "models"
    script, flags = (flags[0], flags[1:]) if flags[0] == SCALE_ONLY else ("grpo.py", flags)
    message = one_line_exit(script, "--model-name-or-path", str(models / "sft"), *flags, cwd=tmp_path)
    assert all(word in message for word in words), message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "models").exists()


def test_a_dataset_needs_a_reward(tiny_checkpoints, tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": f"sort {i}{i + 1}:"}) for i in range(8)))
    models = tiny_checkpoints["cwd"] / "models"
    proc = run_script("grpo.py", "--model-name-or-path", str(models / "sft"), "--dataset-name", "p.jsonl", cwd=tmp_path,
                      check=False)
    assert_one_line_error(proc, "a dataset needs a reward", "--reward-fn", "--reward-model-path")


def test_an_empty_target_is_one_line_for_the_gold_score(tiny_checkpoints, tmp_path):
    rows = [{"prompt": f"sort {i}{i + 1}:", "target": "" if i == 3 else f"{i}{i + 1}"} for i in range(8)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    models = tiny_checkpoints["cwd"] / "models"
    message = one_line_exit("grpo.py", "--model-name-or-path", str(models / "sft"), "--dataset-name", "t.jsonl",
                            "--reward-fn", "gold", cwd=tmp_path)
    assert "empty `target`" in message and "--reward-fn exact_match" in message


def test_policy_logprobs_are_those_of_the_token_after_each_position():
    """policy_logprobs (grpo.py) and scale/'s policy_logprobs: the log-prob at each response token is that of the
    position before it, at the temperature given (2: the log-softmax of logits / 2)."""
    model = PositionLogits()
    sequences = torch.tensor([[0, 3, 4, 5, 6, 2], [0, 0, 7, 1, 9, 8]])  # context 3 (row 1 left-padded), response 3
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    logits = model(sequences).logits
    for temperature in (1.0, 2.0):
        expected = by_hand(logits / temperature, sequences, [(b, p) for b in range(2) for p in range(3, 6)]).view(2, 3)
        logprobs, _ = grpo.policy_logprobs(model, sequences, attention_mask, 3, temperature)
        torch.testing.assert_close(logprobs, expected)
        logprobs, _ = scale_grpo.policy_logprobs(model, sequences, attention_mask, 3, temperature)
        torch.testing.assert_close(logprobs, expected)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_rows_that_repeat_a_prompt_share_its_forward_pass(arch):
    """policy_logprobs over rows that repeat prompts (one left-padded, responses of unequal length): the prompt
    pass sees each distinct prompt once, and the log-probs, entropies and gradients are those of one pass over
    prompt + response; rows with distinct prompts take the one pass."""
    from lm_models import make_model

    torch.manual_seed(0)
    model = make_model(arch, 50).eval()  # dropout off, as the scripts have it
    prompts = [[5, 6, 7], [0, 8, 9], [10, 11, 12]]  # the second left-padded: 0 is padding
    responses = [[13, 14, 1, 0], [15, 1, 0, 0], [16, 17, 18, 1], [19, 20, 1, 0], [21, 22, 23, 24], [25, 1, 0, 0]]
    sequences = torch.tensor([prompts[i // 2] + r for i, r in enumerate(responses)])
    attention_mask = (sequences != 0).long()
    batch_sizes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: batch_sizes.append(len(kwargs["input_ids"])), with_kwargs=True)

    def logprobs_and_grads(shared):
        model.zero_grad()
        if shared:
            logprobs, entropy = scale_grpo.policy_logprobs(model, sequences, attention_mask, 3, 0.7)
        else:  # the one pass, by hand
            logits = model(input_ids=sequences, attention_mask=attention_mask,
                           position_ids=grpo.position_ids_of(attention_mask)).logits[:, 2:-1]
            logprobs, entropy = scale_grpo.token_logprobs(logits, sequences[:, 3:], with_entropy=True, temperature=0.7)
        (logprobs * attention_mask[:, 3:]).sum().backward()
        return logprobs * attention_mask[:, 3:], entropy * attention_mask[:, 3:], [p.grad.clone() for p in model.parameters()]

    shared, one_pass = logprobs_and_grads(True), logprobs_and_grads(False)
    assert batch_sizes == [3, 6, 6]  # distinct prompts, then the responses; then the one pass
    torch.testing.assert_close(shared[0], one_pass[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], one_pass[1], atol=1e-5, rtol=0)
    for a, b in zip(shared[2], one_pass[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    batch_sizes.clear()
    scale_grpo.policy_logprobs(model, sequences[::2], attention_mask[::2], 3, 0.7)
    assert batch_sizes == [3]
    # off the CPU (a GPU; here the meta device stands in for one) the one pass is taken: no model call made here
    assert scale_grpo.shared_prompt_logprobs(model, sequences.to("meta"), attention_mask.to("meta"), 3, 0.7) is None
    assert batch_sizes == [3]


def test_same_seed_same_logs_and_weights(tiny_checkpoints, tmp_path):
    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--num-iterations", "2", "--batch-size", "16", "--num-generations",
             "4", "--mini-batch-size", "8", "--eval-size", "8", "--eval-every", "1", "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("grpo.py", flags, tmp_path)
    assert [tag for tag in logs_a if logs_a[tag] != logs_b.get(tag)] == [] and len(logs_a) >= 5
    assert saved_a == saved_b and len(saved_a) == 1


# ------------------------------------------------------------------------ the direction of one update
def edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row, prev = [i], row
        for j, y in enumerate(b, 1):
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x != y)))
    return row[-1]


def response_token_logprobs(model, sequences, attention_mask, width):
    """log π(token) of every response token (left-padded prompts of `width` tokens), by one forward pass."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).logits.float()
    logp = torch.log_softmax(logits[:, width - 1 : -1], -1)
    return logp.gather(-1, sequences[:, width:, None]).squeeze(-1)


def gold_rewards(tokenizer, sequences, width, mask, missing_eos_penalty=-1.0):
    """The gold score of each sampled completion of the built-in task (its target: the prompt's digits, sorted),
    or the penalty for one without a stop token."""
    prompts = tokenizer.batch_decode(sequences[:, :width], skip_special_tokens=True)
    completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
    stopped = ((sequences[:, width:] == tokenizer.eos_token_id) & mask.bool()).any(1)
    rewards = []
    for prompt, completion, stop in zip(prompts, completions, stopped):
        target = "".join(sorted(prompt.removeprefix("sort ").removesuffix(":")))
        rewards.append(1 - min(1, edit_distance(completion, target) / len(target)) if stop else missing_eos_penalty)
    return torch.tensor(rewards)


def recorded_rollout(module, monkeypatch, rows):
    """Patch `module`'s sampling (generate; scale/'s generate_in_chunks) to record what it returns; returns a function
    giving the call that sampled `rows` completions (the training rollout's size: the evaluation samples another
    number)."""
    name = "generate_in_chunks" if hasattr(module, "generate_in_chunks") else "generate"
    calls, real = [], getattr(module, name)

    def recording(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(module, name, recording)
    return lambda: next(call for call in calls if len(call[0]) == rows)


def test_one_step_raises_the_clipped_surrogate_on_the_sampled_completions(small_checkpoints, tmp_path, monkeypatch):
    """The direction of the update: one step (β = 0, a small learning rate) on one rollout raises GRPO's surrogate
    J = mean_i Â_i · mean_t π_θ(o_i,t) / π_old(o_i,t) on that rollout's completions, the advantages computed here
    from the gold score of each completion (−1 without a stop token) within its group of 4. A loss or an advantage
    of the wrong sign lowers it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rollout = recorded_rollout(grpo, monkeypatch, 16)
    sft_path = small_checkpoints["sft"]
    run_in_process("grpo.py", *CPU_FLOAT32, "--model-name-or-path", str(sft_path), "--num-iterations", "1", "--batch-size", "16",
                   "--num-generations", "4", "--mini-batch-size", "16", "--ppo-epochs", "1", "--beta", "0", "--lr", "1e-4",
                   "--eval-size", "8", "--output-dir", "out", cwd=tmp_path)
    sequences, attention_mask, width, mask, _ = rollout()
    groups = gold_rewards(AutoTokenizer.from_pretrained(sft_path), sequences, width, mask).view(4, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    assert (advantages != 0).sum() >= 4  # something to learn from
    old = response_token_logprobs(AutoModelForCausalLM.from_pretrained(sft_path).eval(), sequences, attention_mask, width)
    new = response_token_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), sequences,
                                  attention_mask, width)
    mask = mask.float()
    gain = (advantages * (((new - old).exp() - 1) * mask).sum(1) / mask.sum(1)).mean()
    assert gain > 1e-5, gain


@pytest.mark.parametrize("script,flags,advantage", [
    ("grpo.py", (), "grpo"),
    ("grpo.py", ("--advantage", "rloo", "--loss-type", "cispo", "--epsilon-high", "4.0"), "rloo"),
    ("grpo.py", ("--scale-rewards", "none", "--loss-type", "dr_grpo", "--importance-sampling-level", "sequence",
                 "--epsilon-high", "0.28", "--temperature", "0.7"), "dr_grpo"),
    # 7 new tokens: the short answers (6 tokens with the stop) finish and the longer ones are cut, whatever is drawn
    ("grpo.py", ("--advantage", "reinforce_pp_baseline", "--mask-truncated-completions", "--response-length", "7"),
     "reinforce_pp_baseline"),
    # L_max 10, not the default 12: a penalty that ignores --response-length fails; the std of the whole batch
    ("scale/grpo.py", ("--soft-overlong-cache", "5", "--response-length", "10", "--scale-rewards", "batch"), "batch"),
    ("grpo.py", ("--advantage", "reinforce_pp", "--epsilon", "0.1"), "reinforce_pp"),
    ("scale/grpo.py", ("--advantage", "maxrl", "--missing-eos-penalty", "0", "--loss-type", "dapo"), "maxrl"),
    ("scale/grpo.py", ("--no-scale-rewards", "--loss-type", "dr_grpo"), "dr_grpo"),  # the older spelling, scale/'s
])
def test_the_variant_flags_reach_the_loss(small_checkpoints, tmp_path, monkeypatch, script, flags, advantage):
    """The advantages the loss receives are, by hand from the gold scores of the recorded completions, GRPO's (r −
    mean) / (std + 1e-4), RLOO's r − mean of the other three, Dr. GRPO's r − mean, or REINFORCE++'s r − mean over
    the batch's root mean square (the centered rewards' batch mean is 0), with no group baseline r − its batch mean
    over their root mean square, MaxRL's r − mean over the mean (--missing-eos-penalty 0), or r − mean over the
    whole batch's std (--scale-rewards batch); --mask-truncated-completions removes the completions with no stop token from the
    loss; --soft-overlong-cache adds DAPO's length penalty to the rewards; --loss-type, --epsilon, --epsilon-high
    and --importance-sampling-level reach the loss's normalization, its clip, the ratio, and CISPO's loss in place
    of the clipped surrogate; and --temperature reaches the sampling (the rollout's and the evaluation's) and the
    update's log-probs (the ratio of the one minibatch, before any step, exactly 1). The reference's variants on
    grpo.py, scale/grpo.py's own (--scale-rewards batch, MaxRL) on it."""
    import importlib

    from transformers import AutoTokenizer

    module = importlib.import_module(script[:-3].replace("/", "."))
    rollout, seen, temperatures = recorded_rollout(module, monkeypatch, 16), [], []
    recording = module.generate

    def generate_spy(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature=1.0, **kwargs):
        temperatures.append(temperature)
        return recording(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature, **kwargs)

    real = {name: getattr(module, name) for name in ("importance_ratio", "clipped_surrogate", "cispo_loss", "aggregate_loss")}

    def ratio_spy(logprobs, old_logprobs, mask, level):
        seen.append(("ratio", level))
        ratio = real["importance_ratio"](logprobs, old_logprobs, mask, level)
        assert torch.equal(ratio, torch.ones_like(ratio))  # one minibatch, before any step: the rollout's log-probs
        return ratio

    def surrogate_spy(ratio, advantages, epsilon_low, epsilon_high):
        seen.append(("surrogate", advantages.detach().clone(), epsilon_low, epsilon_high))
        return real["clipped_surrogate"](ratio, advantages, epsilon_low, epsilon_high)

    def cispo_spy(ratio, logprobs, advantages, epsilon_high):
        seen.append(("cispo", advantages.detach().clone(), None, epsilon_high))
        return real["cispo_loss"](ratio, logprobs, advantages, epsilon_high)

    def aggregate_spy(per_token, mask, loss_type, *normalizers):
        seen.append(("aggregate", loss_type, mask.detach().clone(), normalizers))
        return real["aggregate_loss"](per_token, mask, loss_type, *normalizers)

    for name, spy in (("importance_ratio", ratio_spy), ("clipped_surrogate", surrogate_spy), ("cispo_loss", cispo_spy),
                      ("aggregate_loss", aggregate_spy), ("generate", generate_spy)):
        monkeypatch.setattr(module, name, spy)
    run_in_process(script, *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), "--num-iterations", "1", "--batch-size", "16",
                   "--num-generations", "4", "--mini-batch-size", "16", "--ppo-epochs", "1", "--beta", "0",
                   "--eval-size", "8", "--output-dir", "out", *flags, cwd=tmp_path)
    sequences, _, width, mask, _ = rollout()
    penalty = float(flags[flags.index("--missing-eos-penalty") + 1]) if "--missing-eos-penalty" in flags else -1.0
    r = gold_rewards(AutoTokenizer.from_pretrained(small_checkpoints["sft"]), sequences, width, mask, penalty)
    if "--soft-overlong-cache" in flags:  # DAPO's penalty by hand, L_max 10, L_cache 5: (5 − |o|) / 5 past 5 tokens
        lengths, stopped = mask.sum(1).float(), r != penalty
        penalty = torch.where(stopped & (lengths > 5), (5 - lengths) / 5, torch.zeros_like(r))
        assert (penalty < 0).any(), lengths
        r = r + penalty
    r = r.view(4, 4)
    centered = r - r.mean(1, keepdim=True)
    batch_centered = r - r.mean()
    expected = {"grpo": centered / (r.std(1, keepdim=True) + 1e-4), "rloo": r - (r.sum(1, keepdim=True) - r) / 3,
                "dr_grpo": centered, "reinforce_pp_baseline": centered / centered.pow(2).mean().sqrt(),
                "reinforce_pp": batch_centered / batch_centered.pow(2).mean().sqrt(),
                "batch": centered / (r.flatten().std() + 1e-4), "maxrl": centered / (r.mean(1, keepdim=True) + 1e-6)}[advantage]
    (_, level), (loss, received, epsilon_low, epsilon_high), (_, loss_type, loss_mask, normalizers) = seen
    assert level == (flags[flags.index("--importance-sampling-level") + 1] if "--importance-sampling-level" in flags
                     else "token")
    temperature = float(flags[flags.index("--temperature") + 1]) if "--temperature" in flags else 1.0
    assert temperatures == [temperature] * 3  # the evaluation before training, the rollout, the evaluation after it
    assert (received != 0).any()
    torch.testing.assert_close(received, expected.flatten(), rtol=1e-5, atol=1e-5)
    assert loss_type == (flags[flags.index("--loss-type") + 1] if "--loss-type" in flags else "grpo")
    assert loss == ("cispo" if loss_type == "cispo" else "surrogate")
    epsilon = float(flags[flags.index("--epsilon") + 1]) if "--epsilon" in flags else 0.2
    assert epsilon_high == (float(flags[flags.index("--epsilon-high") + 1]) if "--epsilon-high" in flags else epsilon)
    assert epsilon_low == (None if loss_type == "cispo" else epsilon)
    # --mask-truncated-completions: the loss sees no token of a completion with no stop token, all of the others'
    tokenizer = AutoTokenizer.from_pretrained(small_checkpoints["sft"])
    stops = torch.isin(sequences[:, width:], torch.tensor(grpo.stop_token_ids(tokenizer))) & mask.bool()
    kept = stops.any(1) if "--mask-truncated-completions" in flags else torch.ones(len(mask), dtype=torch.bool)
    torch.testing.assert_close(loss_mask, mask.float() * kept.unsqueeze(1))
    assert kept.any() and ("--mask-truncated-completions" not in flags or not kept.all()), kept
    # the normalizers: the minibatch's 16 completions, the tokens the loss sees (not those masked out), L_max
    response_length = int(flags[flags.index("--response-length") + 1]) if "--response-length" in flags else 12
    assert normalizers == (16, loss_mask.sum().item(), response_length), normalizers


def test_each_epoch_trains_on_every_completion_once(small_checkpoints, tmp_path, monkeypatch):
    """--ppo-epochs 3 over a batch of 16 completions in minibatches of 8: six clipped surrogates, and the two of
    each epoch receive between them every completion's advantage once. A loop that ignores --ppo-epochs fails.
    The policy loss and the KL penalty of each are normalized by the minibatch's 8 completions, not the batch's 16,
    and their tokens by the rollout's ÷ 2 (its minibatches), the same in every step."""
    received, normalizers, real, real_aggregate = [], [], grpo.clipped_surrogate, grpo.aggregate_loss

    def surrogate_spy(ratio, advantages, epsilon_low, epsilon_high):
        received.append(advantages.detach().clone())
        return real(ratio, advantages, epsilon_low, epsilon_high)

    def aggregate_spy(per_token, mask, loss_type, num_sequences, num_tokens, max_completion_length):
        normalizers.append((num_sequences, num_tokens, mask.sum().item()))
        return real_aggregate(per_token, mask, loss_type, num_sequences, num_tokens, max_completion_length)

    monkeypatch.setattr(grpo, "clipped_surrogate", surrogate_spy)
    monkeypatch.setattr(grpo, "aggregate_loss", aggregate_spy)
    run_in_process("grpo.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--num-iterations", "1", "--batch-size",
                   "16", "--num-generations", "4", "--mini-batch-size", "8", "--ppo-epochs", "3", "--eval-size", "4",
                   "--output-dir", "out", cwd=tmp_path)
    assert len(received) == 6
    epochs = [torch.cat(received[i : i + 2]).sort().values for i in (0, 2, 4)]
    assert (epochs[0] != 0).any()
    assert torch.equal(epochs[0], epochs[1]) and torch.equal(epochs[0], epochs[2])
    tokens = normalizers[0][2] + normalizers[2][2]  # the first epoch's two minibatches: the rollout in order
    # six minibatches, each a policy loss and a KL penalty (β 0.04)
    assert [(n, t) for n, t, _ in normalizers] == [(8, tokens / 2)] * 12


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reference_stays_the_starting_model(small_checkpoints, tmp_path, monkeypatch, lora):
    """KL 0 before the first update; after training the reference computes the SFT model's logits exactly (with
    LoRA: the policy itself, its adapters off) while the policy has moved away from it (KL > 0)."""
    if lora:
        pytest.importorskip("peft")
    sft = small_checkpoints["sft"]  # its completions stop and differ in reward: GRPO has something to learn
    flags = ["--model-name-or-path", str(sft), "--num-iterations", "2", "--batch-size", "16", "--num-generations", "4",
                  "--mini-batch-size", "8", "--eval-size", "8", "--eval-every", "2", "--output-dir", "out", *(["--lora-r", "4"] if lora else [])]
    scalars, reference = reference_after_training("scale/grpo.py" if lora else "grpo.py", flags, tmp_path, monkeypatch)
    assert_the_reference_stayed(sft, tmp_path / "out", reference, scalars)


def test_it_raises_the_reward_in_20_iterations(small_checkpoints, tmp_path):
    """From the small SFT model, 20 iterations of 16 prompts × 8 completions (lr 5e-4): the mean reward of the
    sampled completions over the last 5 iterations exceeds that of the first 5 by 0.054-0.086 (seeds 1-3), at
    least 0.02; with the policy loss's sign flipped it falls by 0.83."""
    run_in_process("grpo.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--num-iterations", "20",
                   "--batch-size", "128", "--num-generations", "8", "--mini-batch-size", "64", "--lr", "5e-4",
                   "--eval-every", "20", "--eval-size", "16", "--output-dir", "out", cwd=tmp_path)
    reward = [v for _, v in read_scalars(only_run_dir(tmp_path))["objective/reward"]]
    assert len(reward) == 20 and sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.02, reward


# ------------------------------------------------------------------------ DAPO's dynamic sampling
HALF_CONSTANT = """import re

def half_constant(prompts, completions, **columns):
    # a prompt whose digits add up to an even number: 1.0 for every completion (a group of equal rewards);
    # otherwise the parity of the completion's length, which differs within most groups
    return [1.0 if sum(map(int, re.findall(r"[0-9]", p))) % 2 == 0 else float(len(c) % 2)
            for p, c in zip(prompts, completions)]
"""


def half_constant_rewards(tokenizer, sequences, width, mask):
    """HALF_CONSTANT's reward of each recorded completion, or −1 without a stop token (--missing-eos-penalty)."""
    prompts = tokenizer.batch_decode(sequences[:, :width], skip_special_tokens=True)
    completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
    stopped = ((sequences[:, width:] == tokenizer.eos_token_id) & mask.bool()).any(1)
    return torch.tensor([(1.0 if sum(int(ch) for ch in p if ch.isdigit()) % 2 == 0 else float(len(c) % 2)) if stop
                         else -1.0 for p, c, stop in zip(prompts, completions, stopped)])


def test_dynamic_sampling_trains_on_the_groups_that_differ(small_checkpoints, tmp_path, monkeypatch):
    """--dynamic-sampling: batches of 4 prompts are sampled until 4 groups whose rewards differ are found; the loss
    receives exactly those groups' GRPO advantages, in the order sampled, computed here by hand from each recorded
    batch's rewards; the groups of equal rewards are dropped (a filter that keeps them fails: their advantages are
    0); the logs count the prompts sampled and the zero-std fraction before and after."""
    from transformers import AutoTokenizer

    (tmp_path / "half.py").write_text(HALF_CONSTANT)
    calls, real_sample, seen = [], grpo.generate, []

    def recording(*args, **kwargs):
        calls.append(real_sample(*args, **kwargs))
        return calls[-1]

    real_surrogate = grpo.clipped_surrogate

    def surrogate_spy(ratio, advantages, epsilon_low, epsilon_high):
        seen.append(advantages.detach().clone())
        return real_surrogate(ratio, advantages, epsilon_low, epsilon_high)

    monkeypatch.setattr(grpo, "generate", recording)
    monkeypatch.setattr(grpo, "clipped_surrogate", surrogate_spy)
    run_in_process("grpo.py", *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-fn",
                   str(tmp_path / "half.py") + ":half_constant", "--num-iterations", "1", "--batch-size", "16",
                   "--num-generations", "4", "--mini-batch-size", "16", "--ppo-epochs", "1", "--beta", "0",
                   "--eval-size", "8", "--dynamic-sampling", "--max-sampling-rounds", "6", "--output-dir", "out",
                   cwd=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(small_checkpoints["sft"])
    batches = [call for call in calls if len(call[0]) == 16]  # the training batches (the evaluations sample 8)
    groups = torch.cat([half_constant_rewards(tokenizer, s, w, m) for s, _, w, m, _ in batches]).view(-1, 4)
    differ = groups.amax(1) > groups.amin(1)
    # as many batches as it took to find 4 groups that differ, and one or more groups of equal rewards dropped
    assert int(differ[:-4].sum()) < 4 <= int(differ.sum()) and len(batches) <= 6
    assert len(batches) > 1 and (~differ).any(), differ
    kept = groups[differ][:4]
    expected = (kept - kept.mean(1, keepdim=True)) / (kept.std(1, keepdim=True) + 1e-4)
    (received,) = seen
    torch.testing.assert_close(received, expected.flatten(), rtol=1e-5, atol=1e-5)
    logs = read_run(tmp_path, "grpo")
    assert logs["objective/prompts_sampled"] == [(1, 4.0 * len(batches))]
    assert logs["objective/zero_std_fraction_sampled"][0][1] == pytest.approx(float((~differ).float().mean()))
    assert logs["objective/zero_std_fraction"] == [(1, 0.0)]


def test_dynamic_sampling_fills_the_batch_when_the_cap_is_reached(tiny_checkpoints, tmp_path):
    """Every group's rewards equal: --max-sampling-rounds 2 batches of prompts per iteration, then the batch is
    filled with groups of equal rewards, and one line says so, once for the whole run."""
    (tmp_path / "same.py").write_text("def same(prompts, completions, **columns):\n    return [0.5] * len(completions)\n")
    proc = run_script("grpo.py", "--model-name-or-path", str(tiny_checkpoints["cwd"] / "models" / "sft"), "--reward-fn",
                      "same.py:same", "--missing-eos-penalty", "0.5", "--num-iterations", "2", "--batch-size", "8",
                      "--num-generations", "4", "--mini-batch-size", "8", "--eval-size", "4", "--dynamic-sampling",
                      "--max-sampling-rounds", "2", cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dynamic sampling:")]
    assert len(lines) == 1 and "--max-sampling-rounds 2" in lines[0], proc.stdout
    logs = read_run(tmp_path, "grpo")
    assert logs["objective/prompts_sampled"] == [(1, 4.0), (2, 4.0)]
    assert [v for _, v in logs["objective/zero_std_fraction"]] == [1.0, 1.0]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_the_kl_penalty_is_to_the_reference_and_never_negative(small_checkpoints, tmp_path, monkeypatch, loss_type):
    """β's term in the loss: in iteration 2, where the rollout policy has moved away from the reference, the KL the
    update penalizes is k3 against the reference's log-probs (computed here from the SFT checkpoint), not the rollout
    policy's; and the logged penalty, β times a mean of k3 ≥ 0, is 0 in iteration 1 (its one step is taken where the
    policy is the reference) and positive in iteration 2, where it is β times k3 aggregated as the loss is. A
    penalty of the wrong sign, one taken against the rollout policy, or one that ignores --beta fails; under dr_grpo,
    one divided by another L_max than --response-length's too."""
    from transformers import AutoModelForCausalLM

    calls, penalized = [], []
    real_sample, real_kl = grpo.generate, grpo.kl_estimators

    def recording(*args, **kwargs):
        calls.append(real_sample(*args, **kwargs))
        return calls[-1]

    def kl_spy(logprobs, ref_logprobs, mask):
        k1, k3 = real_kl(logprobs, ref_logprobs, mask)
        if torch.is_grad_enabled():  # the update's call, not the rollout's statistics
            penalized.append((ref_logprobs.detach().clone(), k3.detach().clone(), mask.clone()))
        return k1, k3

    monkeypatch.setattr(grpo, "generate", recording)
    monkeypatch.setattr(grpo, "kl_estimators", kl_spy)
    sft_path = small_checkpoints["sft"]
    run_in_process("grpo.py", *CPU_FLOAT32, "--model-name-or-path", str(sft_path), "--num-iterations", "2", "--batch-size", "16",
                   "--num-generations", "4", "--mini-batch-size", "16", "--ppo-epochs", "1", "--beta", "0.5",
                   "--lr", "1e-3", "--no-anneal-lr", "--eval-size", "4", "--eval-every", "10", "--output-dir", "out",
                   "--loss-type", loss_type, cwd=tmp_path)
    sequences, attention_mask, width, mask, _ = [call for call in calls if len(call[0]) == 16][1]  # iteration 2's
    reference = response_token_logprobs(AutoModelForCausalLM.from_pretrained(sft_path).eval(), sequences,
                                        attention_mask, width)
    valid = mask.bool()
    assert len(penalized) == 2
    torch.testing.assert_close(penalized[1][0][valid], reference[valid], atol=1e-5, rtol=0)
    penalties = [v for _, v in read_run(tmp_path, "grpo")["losses/kl_penalty"]]
    assert penalties[0] == 0.0 and penalties[1] > 0, penalties
    _, k3, loss_mask = penalized[1]  # the logged penalty is β = 0.5 times k3 aggregated as the loss is
    expected = 0.5 * grpo.aggregate_loss(k3, loss_mask, loss_type, 16, max(1.0, loss_mask.sum().item()), 12)
    assert penalties[1] == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("flags", [
    ("--loss-type", "dppo", "--dppo-divergence", "binary_kl", "--epsilon", "0.05", "--epsilon-high", "0.07",
     "--top-entropy-quantile", "0.4", "--entropy-coef", "0.02", "--cov-method", "kl_cov", "--kl-cov-ratio", "0.1"),
    ("--loss-type", "vespo", "--vespo-k-pos", "1.5", "--vespo-lambda-pos", "2.5", "--vespo-k-neg", "2.5",
     "--vespo-lambda-neg", "1.5", "--cov-method", "clip_cov", "--clip-cov-lb", "-5", "--clip-cov-ub", "5",
     "--clip-cov-ratio", "0.3"),
    ("--loss-type", "sapo", "--sapo-temperature-pos", "2", "--sapo-temperature-neg", "3", "--reward-fn", "gold",
     "--reward-fn", "format", "--format-pattern", "[0-4]*", "--reward-weights", "1", "0.5",
     "--multi-objective-aggregation", "normalize_then_sum"),
])
def test_the_2026_flags_reach_the_loss_with_the_tensors_of_their_moment(small_checkpoints, tmp_path, monkeypatch, flags):
    """scale/grpo.py's 2026 variants, one iteration, one minibatch: each variant's function receives its flags' values and the tensors of the right
    moment. DPPO's trust region: the sampler's log-probs of the recorded rollout, and the update's own log-probs
    (the first minibatch: π_old's exactly); VESPO's weight: log ρ = 0 (π_θ is π_old before any step) and the
    flags' k and λ; SAPO's temperatures; the 80/20 mask and the entropy bonus: the update's entropies, with a
    gradient only for the bonus; KL-Cov's and Clip-Cov's fractions and bounds; GDPO: the reward terms of the
    recorded completions (the gold score and the format, --missing-eos-penalty for an unfinished one) and the
    weights."""
    from transformers import AutoTokenizer

    rollout, seen = recorded_rollout(scale_grpo, monkeypatch, 16), {}
    spied = ("token_losses", "dppo_trust_region", "vespo_weights", "high_entropy_mask", "entropy_bonus", "kl_cov_tokens",
             "clip_cov_tokens", "compute_advantages")

    def spy(name, real):
        def recording(*args):
            seen.setdefault(name, []).append(args)
            return real(*args)
        return recording

    for name in spied:
        monkeypatch.setattr(scale_grpo, name, spy(name, getattr(scale_grpo, name)))
    run_in_process("scale/grpo.py", *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), "--num-iterations",
                   "1", "--batch-size", "16", "--num-generations", "4", "--mini-batch-size", "16", "--ppo-epochs", "1",
                   "--beta", "0", "--eval-size", "8", "--output-dir", "out", *flags, cwd=tmp_path)
    sequences, _, width, mask, sampler_logprobs = rollout()
    (ratio, logprobs, advantages, loss_type, _, _, weights, temperatures), = seen["token_losses"]
    assert loss_type == flags[1] and torch.equal(ratio, torch.ones_like(ratio))
    if loss_type == "dppo":
        (trained, sampler, _, divergence, low, high), = seen["dppo_trust_region"]
        assert torch.equal(sampler, sampler_logprobs) and torch.equal(trained, logprobs)
        assert (divergence, low, high) == ("binary_kl", 0.05, 0.07)
        (entropy, _, quantile), (for_bonus, _, _) = seen["high_entropy_mask"]  # the policy loss's, the bonus's
        (bonus_entropy, bonus_mask), = seen["entropy_bonus"]
        assert quantile == 0.4 and entropy is for_bonus is bonus_entropy and entropy.requires_grad  # the update's
        assert 0 < bonus_mask.sum() < mask.sum()  # the 80/20 mask: the high-entropy 40% of the tokens
        assert seen["kl_cov_tokens"][0][2] == 0.1
    if loss_type == "vespo":
        (log_ratio, _, _, is_weights, *constants), = seen["vespo_weights"]
        assert (log_ratio == 0).all() and is_weights is None and constants == [1.5, 2.5, 2.5, 1.5]
        assert weights is not None and seen["clip_cov_tokens"][0][3:] == (0.3, -5.0, 5.0)
    if loss_type == "sapo":
        assert temperatures == (2.0, 3.0)
        tokenizer = AutoTokenizer.from_pretrained(small_checkpoints["sft"])
        gold = gold_rewards(tokenizer, sequences, width, mask)
        completions = tokenizer.batch_decode(sequences[:, width:], skip_special_tokens=True)
        form = torch.tensor([float(re.fullmatch("[0-4]*", c, re.DOTALL) is not None) for c in completions])
        terms = torch.stack([gold, torch.where(gold == -1, -1.0, form)], 1)
        (_, _, _, _, table, reward_weights), = seen["compute_advantages"]
        torch.testing.assert_close(table, terms)
        assert reward_weights == (1.0, 0.5)
