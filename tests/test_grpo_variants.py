"""The 2026 variants, scale/grpo.py's alone, against hand computations, with unequal constants: MaxRL's and
batch-scaled advantages, GDPO's normalize_then_sum (and dynamic sampling by its terms), DPPO's trust region, SAPO's
gate, VESPO's weight and the loss types' normalizers, the entropy controls (the 80/20 mask, the bonus and its
adaptive coefficient), Clip-Cov and KL-Cov; and pass@k, in both tiers."""
import json
import math

import pytest
import torch
from conftest import CPU_FLOAT32, only_run_dir, read_scalars, run_in_process

import grpo
from scale import grpo as scale_grpo

BOTH = pytest.mark.parametrize("module", [grpo, scale_grpo])
SCALE = pytest.mark.parametrize("module", [scale_grpo], ids=["scale.grpo"])  # the variants scale/grpo.py alone has


@SCALE
def test_batch_scaled_and_maxrl_advantages(module):
    """Rewards 1, 0, 0, 0 | 1, 1, 1, 0 in groups of G = 4. Batch scaling: r − the group mean (0.25; 0.75) over the
    std of all 8 rewards (four 1s and four 0s: mean 0.5, variance 8 · 0.25 / 7 → std 0.534522). MaxRL:
    (r − mean) / mean: 0.75 / 0.25 = 3, −1, −1, −1 | 0.25 / 0.75 = 1/3 (×3), −1."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    torch.testing.assert_close(module.compute_advantages(rewards, 4, "grpo", "batch"),
                               centered / (math.sqrt(2 / 7) + 1e-4))
    torch.testing.assert_close(module.compute_advantages(rewards, 4, "maxrl", "group"),
                               torch.tensor([3.0, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.compute_advantages(torch.zeros(4), 4, "maxrl", "group"), torch.zeros(4))
    # "none" and False (Dr. GRPO's flag) are the same, and "group" is True
    torch.testing.assert_close(module.compute_advantages(rewards, 4, "grpo", "none"), centered)
    torch.testing.assert_close(module.compute_advantages(rewards, 4, "grpo", "group"),
                               module.compute_advantages(rewards, 4, "grpo", True))


@SCALE
def test_normalize_then_sum_is_gdpo(module):
    """Two terms, weights 1 and 2, groups of G = 2. Term 1: (1, 0) → ±0.5 / (std √0.5 + 1e-4); (1, 1) → 0.
    Term 2: (0.2, 0.6) → ∓0.2 / (std √0.08 + 1e-4); (NaN, 0.4): one value, std NaN, so it adds nothing. The sums
    A = a1 + 2 a2, then (A − mean A) / (std A + 1e-4) over the batch, n − 1 in the std."""
    table = torch.tensor([[1.0, 0.2], [0.0, 0.6], [1.0, math.nan], [1.0, 0.4]])
    a1, a2 = 0.5 / (math.sqrt(0.5) + 1e-4), 0.2 / (math.sqrt(0.08) + 1e-4)
    summed = torch.tensor([a1 - 2 * a2, -a1 + 2 * a2, 0.0, 0.0])
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    got = module.compute_advantages(torch.zeros(4), 2, "grpo", "group", table, (1.0, 2.0))
    torch.testing.assert_close(got, expected)
    # a completion no term applies to gets Â = 0 and stays out of the batch's statistics
    table = torch.tensor([[1.0, 0.2], [0.0, 0.6], [math.nan, math.nan], [1.0, 0.4]])
    got = module.compute_advantages(torch.zeros(4), 2, "grpo", "group", table, (1.0, 2.0))
    kept = torch.tensor([a1 - 2 * a2, -a1 + 2 * a2, 0.0])
    torch.testing.assert_close(got[[0, 1, 3]], (kept - kept.mean()) / (kept.std() + 1e-4))
    assert got[2] == 0


@SCALE
def test_dynamic_sampling_keeps_a_group_whose_terms_differ_though_its_sums_are_equal(module):
    """Three terms, groups of G = 3: (2, 0, 0), (0, 1, 1), (0, 1, 1) sum to 2 each, but the terms' stds differ
    (1.154701 and 0.577350), so GDPO gives them Â ≠ 0: the group is kept. A group equal in every term is dropped;
    judged by its sums, both would be. (1, .5, 0), (.5, .5, .5), (0, .5, 1): one term equal, two differing: kept."""
    table = torch.tensor([[2.0, 0, 0], [0, 1, 1], [0, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0],
                          [1, 0.5, 0], [0.5, 0.5, 0.5], [0, 0.5, 1]])
    assert module.informative_groups(table, 3).tolist() == [True, False, True]
    assert module.informative_groups(table.sum(1), 3).tolist() == [False, False, False]
    assert module.compute_advantages(table.sum(1), 3, "grpo", "group", table, (1.0, 1.0, 1.0))[:3].abs().min() > 0.5


@SCALE
def test_dppo_trust_region_drops_the_tokens_that_moved_too_far_the_way_their_advantage_pushes(module):
    """p_θ = 0.5, 0.1 | 0.2, 0.3 against the sampler's 0.1, 0.5 | 0.2, 0.25; Â = 1, −1; δ_low 0.2, δ_high 0.3.
    binary_tv: token (0, 0) rose by 0.4 > δ_high with Â > 0: dropped; (0, 1) fell: kept; row 1 (Â < 0): (1, 0)
    did not move, (1, 1) rose (the safe way): kept. binary_kl of (0, 0): 0.1 log(0.1/0.5) + 0.9 log(0.9/0.5)
    = 0.368064: dropped at δ_high 0.3, kept at 0.4. With Â = −1 in row 0, token (0, 1) fell by 0.4 > δ_low."""
    logprobs = torch.tensor([[0.5, 0.1], [0.2, 0.3]]).log()
    sampler = torch.tensor([[0.1, 0.5], [0.2, 0.25]]).log()
    advantages = torch.tensor([1.0, -1.0])
    keep = module.dppo_trust_region(logprobs, sampler, advantages, "binary_tv", 0.2, 0.3)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    assert module.dppo_trust_region(logprobs, sampler, advantages, "binary_tv", 0.2, 0.45).all()
    kl = 0.1 * math.log(0.1 / 0.5) + 0.9 * math.log(0.9 / 0.5)
    assert 0.3 < kl < 0.4
    assert module.dppo_trust_region(logprobs, sampler, advantages, "binary_kl", 0.2, 0.3).tolist() == [[0, 1], [1, 1]]
    assert module.dppo_trust_region(logprobs, sampler, advantages, "binary_kl", 0.2, 0.4).all()
    keep = module.dppo_trust_region(logprobs, sampler, torch.tensor([-1.0, -1.0]), "binary_tv", 0.2, 0.3)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    # the loss: −ρ Â on the kept tokens, its gradient ρ Â ∇log π (dppo's plain surrogate)
    ratio = torch.tensor([[1.5, 0.8], [1.0, 1.2]])
    torch.testing.assert_close(module.token_losses(ratio, logprobs, advantages, "dppo", 0.2, 0.3),
                               torch.tensor([[-1.5, -0.8], [1.0, 1.2]]))


@SCALE
def test_sapo_gate(module):
    """ρ = 1.2 with Â = 2 (τ_pos 1): −(4/1) σ(0.2) · 2 = −4.398668; ρ = 0.9 with Â = −1 (τ_neg 1.05):
    (4/1.05) σ(−0.105) = 1.804852. At ρ = 1 the gradient is −Â ∂ρ, the unclipped surrogate's."""
    ratio = torch.tensor([[1.2], [0.9]])
    got = module.token_losses(ratio, ratio.log(), torch.tensor([2.0, -1.0]), "sapo", 0.2, 0.2, None, (1.0, 1.05))
    torch.testing.assert_close(got, torch.tensor([[-8 / (1 + math.exp(-0.2))], [4 / 1.05 / (1 + math.exp(0.105))]]))
    ratio = torch.ones(1, 1, requires_grad=True)
    module.sapo_loss(ratio, torch.tensor([-3.0]), 1.0, 1.05).sum().backward()
    torch.testing.assert_close(ratio.grad, torch.tensor([[3.0]]))


@SCALE
def test_vespo_weight_and_loss(module):
    """Row 0: log ρ 0.1, 0.2 (both counted), Â = 1 ≥ 0 (k 2, λ 3): log w = 0.3, log φ = 3 + 0.6 − 3 e^0.3 =
    −0.449576. Row 1: log ρ −0.3 and a padded 5.0 (not counted), Â = −1 (k 3, λ 2): log φ = 2 − 0.9 − 2 e^−0.3.
    With a sampler correction of 1.5 at (0, 0): log w = 0.3 + log 1.5. The loss −φ Â log π."""
    log_ratio, mask = torch.tensor([[0.1, 0.2], [-0.3, 5.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0])
    phi = module.vespo_weights(log_ratio, mask, advantages, None, 2.0, 3.0, 3.0, 2.0)
    expected = [math.exp(3 + 0.6 - 3 * math.exp(0.3)), math.exp(2 - 0.9 - 2 * math.exp(-0.3))]
    torch.testing.assert_close(phi, torch.tensor(expected).unsqueeze(1))
    w = 0.3 + math.log(1.5)
    phi = module.vespo_weights(log_ratio, mask, advantages, torch.tensor([[1.5, 1.0], [1.0, 1.0]]), 2.0, 3.0, 3.0, 2.0)
    assert phi[0, 0].item() == pytest.approx(math.exp(3 + 2 * w - 3 * math.exp(w)), rel=1e-5)
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    torch.testing.assert_close(module.token_losses(None, logprobs, advantages, "vespo", 0.2, 0.2, phi),
                               -phi * advantages.unsqueeze(1) * logprobs)


@SCALE
def test_the_new_loss_types_normalizers(module):
    """Losses 1, 2, 3 | 4, pad (mask 1, 1, 1 | 1, 0), B = 2, N = 5 (a minibatch's share of the rollout's tokens):
    sapo as grpo (2 + 4) / 2 = 3; luspo each completion's sum, over B: (6 + 4) / 2 = 5; dppo and vespo as dapo,
    10 / 5 = 2."""
    losses, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]]), torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    expected = {"sapo": 3.0, "luspo": 5.0, "dppo": 2.0, "vespo": 2.0}
    for loss_type, value in expected.items():
        assert module.aggregate_loss(losses, mask, loss_type, 2, 5.0, 3).item() == pytest.approx(value), loss_type


@SCALE
def test_high_entropy_mask_keeps_the_top_quantile(module):
    """Entropies .1 .9 .5 | .7 .3 (pad 5.0, not counted). ρ = 0.2: the 0.8 quantile of the five, .7 + 0.2 · (.9 − .7)
    = .74, keeps .9 alone; ρ = 0.5: the median .5 keeps .9, .5 and .7; ρ = 1 keeps all five, never the padding."""
    entropy = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 5.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    assert module.high_entropy_mask(entropy, mask, 0.2).tolist() == [[False, True, False], [False, False, False]]
    assert module.high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, True, True], [True, False, False]]
    assert module.high_entropy_mask(entropy, mask, 1.0).tolist() == [[True, True, True], [True, True, False]]


@SCALE
def test_entropy_bonus_and_its_adaptive_coefficient(module):
    """H̄ over the masked tokens: (1 + 3) / 2. The coefficient: 0.01 + 0.005 when H̄ = 0.1 ≤ 0.2, 0.01 − 0.005 when
    0.3 > 0.2, held within [0.004, 0.012]. EntropyControl applies no bonus before its first measurement (TRL), then
    c only while the entropy measured at the last step was at most the target."""
    entropy, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert module.entropy_bonus(entropy, mask).item() == 2.0
    assert module.adaptive_entropy_coef(0.01, 0.1, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)
    assert module.adaptive_entropy_coef(0.01, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.005)
    assert module.adaptive_entropy_coef(0.01, 0.1, 0.2, 0.005, 0.0, 0.012) == 0.012
    assert module.adaptive_entropy_coef(0.007, 0.3, 0.2, 0.005, 0.004, 1.0) == 0.004
    args = pytest.importorskip("types").SimpleNamespace(entropy_coef=0.5, use_adaptive_entropy=True, entropy_target=2.5,
                                                        entropy_coef_delta=0.1, entropy_coef_min=0.0, entropy_coef_max=1.0,
                                                        top_entropy_quantile=1.0, gradient_accumulation_steps=1)
    control = module.EntropyControl(args)
    assert control.bonus(entropy, mask, {}).item() == 0.0  # not yet measured; H̄ = 2 ≤ 2.5: c → 0.6
    assert control.bonus(entropy, mask, {}).item() == pytest.approx(0.6 * 2)  # c → 0.7
    high = torch.tensor([[3.0, 0.0], [4.0, 0.0]])  # H̄ = 3.5 > 2.5: applied (last was 2), then c → 0.6
    assert control.bonus(high, mask, {}).item() == pytest.approx(0.7 * 3.5)
    assert control.bonus(entropy, mask, {}).item() == 0.0 and control.coef == pytest.approx(0.7)


@SCALE
def test_token_covariance_and_the_cov_methods_tokens(module):
    """log π −1, −2 | −3, −0.5 (mean −1.625), Â 1 | −0.5 per completion (token mean 0.25): Cov = 0.625 · 0.75,
    −0.375 · 0.75 | −1.375 · −0.75, 1.125 · −0.75 = 0.46875, −0.28125 | 1.03125, −0.84375. Clip-Cov with bounds
    (0.4, 1.1) and r·N = 2: both 0.46875 and 1.03125; with 1.03125's token already clipped, 0.46875 alone.
    KL-Cov, k·N = 1: the largest, 1.03125; k·N = 2: and 0.46875."""
    logprobs, advantages, mask = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]]), torch.tensor([1.0, -0.5]), torch.ones(2, 2)
    covariance = module.token_covariance(advantages, logprobs, mask)
    torch.testing.assert_close(covariance, torch.tensor([[0.46875, -0.28125], [1.03125, -0.84375]]))
    no_cut = torch.zeros(2, 2, dtype=torch.bool)
    assert module.clip_cov_tokens(covariance, mask, no_cut, 0.5, 0.4, 1.1).tolist() == [[True, False], [True, False]]
    cut = torch.tensor([[False, False], [True, False]])
    assert module.clip_cov_tokens(covariance, mask, cut, 0.5, 0.4, 1.1).tolist() == [[True, False], [False, False]]
    assert module.clip_cov_tokens(covariance, mask, no_cut, 0.5, 0.5, 1.1).tolist() == [[False, False], [True, False]]
    assert module.kl_cov_tokens(covariance, mask, 0.25).tolist() == [[False, False], [True, False]]
    assert module.kl_cov_tokens(covariance, mask, 0.5).tolist() == [[True, False], [True, False]]
    # a padded token is never chosen, though its covariance were the largest
    padded = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    assert not module.kl_cov_tokens(module.token_covariance(advantages, logprobs, padded), padded, 0.25)[1, 0]


def test_dppo_s_mask_in_the_loss():
    """grpo_token_losses with --loss-type dppo (binary TV, δ 0.1): the sampler's probabilities 0.3 where π_θ's are
    0.5 (risen by 0.2, Â > 0: out of the region) and 0.45 (by 0.05: in), the other row's fallen by 0.2 with Â < 0
    (out) and risen (the safe way): the two tokens out get loss 0, the others −ρ Â, and the count is 2."""
    from types import SimpleNamespace

    logprobs = torch.tensor([[0.5, 0.5], [0.3, 0.6]]).log()
    sampler = torch.tensor([[0.3, 0.45], [0.5, 0.4]]).log()
    old = SimpleNamespace(logprobs=logprobs - 0.1, is_weights=None)
    mask = torch.ones(2, 2)
    batch = SimpleNamespace(mask=mask, loss_mask=mask, sampler_logprobs=sampler)
    advantages, mb = torch.tensor([1.0, -2.0]), torch.arange(2)
    ratio = (logprobs - old.logprobs).exp()
    args = scale_grpo.Args(loss_type="dppo", epsilon=0.1)
    losses, counts = scale_grpo.grpo_token_losses(ratio, logprobs, torch.zeros(2, 2), advantages, batch, old, mb, 0.1, args)
    rho = math.exp(0.1)
    torch.testing.assert_close(losses, torch.tensor([[0.0, -rho], [0.0, 2 * rho]]))
    assert counts["dppo_masked"] == 2


def test_the_cov_methods_in_the_loss():
    """grpo_token_losses with --cov-method: Clip-Cov's chosen tokens get loss 0 (no gradient), KL-Cov's get
    β |log π_θ − log π_old| added (β 0.5; log ρ = ±0.2 here), the others the loss type's own."""
    from types import SimpleNamespace

    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]])
    old = SimpleNamespace(logprobs=logprobs + torch.tensor([[0.2, 0.0], [-0.2, 0.0]]), is_weights=None)
    mask = torch.ones(2, 2)
    batch = SimpleNamespace(mask=mask, loss_mask=mask, sampler_logprobs=old.logprobs)
    advantages, mb = torch.tensor([1.0, -0.5]), torch.arange(2)
    ratio = (logprobs - old.logprobs).exp()
    args = scale_grpo.Args(cov_method="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=0.5)
    plain = scale_grpo.token_losses(ratio, logprobs, advantages, "grpo", 0.2, 0.2)
    losses, counts = scale_grpo.grpo_token_losses(ratio, logprobs, torch.zeros(2, 2), advantages, batch, old, mb, 0.2, args)
    chosen = scale_grpo.kl_cov_tokens(scale_grpo.token_covariance(advantages, logprobs, mask), mask, 0.5)
    torch.testing.assert_close(losses, plain + 0.5 * 0.2 * chosen)
    assert counts["cov_selected"] == 2 and chosen[1, 0]  # log ρ = 0.2 there: the penalty is not 0
    args = scale_grpo.Args(cov_method="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-5.0, clip_cov_ub=5.0)
    torch.manual_seed(0)
    losses, counts = scale_grpo.grpo_token_losses(ratio, logprobs, torch.zeros(2, 2), advantages, batch, old, mb, 0.2, args)
    assert counts["cov_selected"] == 2 and (losses == 0).sum() == 2
    torch.testing.assert_close(losses[losses != 0], plain[losses != 0])


@BOTH
def test_pass_at_k_is_chen_et_al_s_unbiased_estimator(module):
    """n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 − C(3, 2)/C(4, 2) = 1/2, pass@4 = 1. n = 5, c = 2: pass@2 = 1 − 3/10.
    Two prompts of n = 4 with 1 and 2 passes: pass@1 = (1/4 + 1/2) / 2, pass@2 = (1/2 + 5/6) / 2, pass@4 = 1."""
    assert [module.pass_at_k(4, 1, k) for k in (1, 2, 4)] == pytest.approx([0.25, 0.5, 1.0])
    assert module.pass_at_k(5, 2, 2) == pytest.approx(0.7) and module.pass_at_k(5, 0, 4) == 0.0
    passed = [True, False, False, False, True, True, False, False]
    logs = grpo.pass_at_k_logs(passed, 4)
    assert logs == pytest.approx({"eval/pass@1": 0.375, "eval/pass@2": (0.5 + 5 / 6) / 2, "eval/pass@4": 1.0})
    assert grpo.pass_at_k_logs(passed, 1) == {} and grpo.pass_at_k_logs(None, 4) == {}
    sums = scale_grpo.pass_at_k_logs(passed, 4, [1, 0])  # a rank's sums; the second prompt is shard's padding
    assert sums == pytest.approx({"eval/pass@1": 0.25, "eval/pass@2": 0.5, "eval/pass@4": 1.0})


def test_passes_by_the_target_or_by_every_reward_function_that_applies():
    """The built-in task: exactly the target. Else each function that applies scores ≥ 1 (NaN: does not apply), one
    at least; the reward model's column never counts, and with only a reward model there is no pass@k."""
    rows = [{"target": "12"}, {"target": "3"}]
    assert grpo.passes(["12", "3 "], rows, None, [], True) == [True, False]
    table = torch.tensor([[1.0, math.nan, -5.0], [1.0, 0.0, 9.0], [math.nan, math.nan, 9.0]])
    names = ["exact_match", "format", "reward_model"]
    assert grpo.passes(["a", "b", "c"], rows + rows[:1], table, names, False) == [True, False, False]
    assert grpo.passes(["a"], rows[:1], table[:1, 2:], ["reward_model"], False) is None


@pytest.mark.parametrize("script", ["grpo.py", "rlhf_ppo.py", "distill.py"])
def test_pass_at_k_and_the_training_samples_in_each_script(script, small_checkpoints, tmp_path):
    """--eval-num-samples 4: eval/pass@1, @2, @4 are logged. grpo.py and rlhf_ppo.py on a dataset whose reward
    function passes a completion by its prompt alone (an even number): each prompt's 4 samples all pass or all
    fail, so pass@k is the same at every k, the fraction of even prompts; samples counted with another prompt's
    would raise pass@4. distill.py on the built-in task: pass@1 is the accuracy over all the samples (its unbiased
    estimate) and pass@k does not fall with k. --log-completions-every 1: the rollout's prompts and completions are
    in TensorBoard's text tab at each iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"prompt": f"sort {n}:", "target": "".join(sorted(str(n)))} for n in range(1000, 1100)]
    (tmp_path / "sorts.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    (tmp_path / "parity.py").write_text("def even(prompts, completions, **columns):\n"
                                        "    return [float(int(p.split()[1][:-1]) % 2 == 0) for p in prompts]\n")
    data = ["--dataset-name", str(tmp_path / "sorts.jsonl"), "--reward-fn", f"{tmp_path / 'parity.py'}:even",
            "--mini-batch-size", "8", "--missing-eos-penalty", "0"]
    sft = str(small_checkpoints["sft"])
    models = {"grpo.py": ["--model-name-or-path", sft, "--num-generations", "4", *data],
              "rlhf_ppo.py": ["--model-name-or-path", sft, "--reward-model-path", "None", *data],
              "distill.py": ["--model-name-or-path", sft, "--teacher-model-name-or-path", sft]}[script]
    run_in_process(script, *CPU_FLOAT32, *models, "--num-iterations", "2", "--batch-size", "16", "--eval-size", "32",
                   "--eval-every", "2", "--eval-num-samples", "4", "--log-completions-every", "1", "--output-dir", "out",
                   cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    for step in (0, 2):
        value = {tag: dict(scalars[tag])[step] for tag in ("eval/gold_accuracy", "eval/pass@1", "eval/pass@2",
                                                           "eval/pass@4") if tag in scalars}
        if script == "distill.py":
            assert value["eval/pass@1"] == pytest.approx(value["eval/gold_accuracy"], abs=1e-6)
            assert value["eval/pass@1"] <= value["eval/pass@2"] <= value["eval/pass@4"]
        else:
            assert 0.2 < value["eval/pass@1"] == value["eval/pass@2"] == value["eval/pass@4"] < 0.8, value
    events = EventAccumulator(only_run_dir(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    texts = [e for e in events.Tensors("train/completions/text_summary")]
    assert [e.step for e in texts] == [1, 2] and "sort " in texts[0].tensor_proto.string_val[0].decode()


def test_the_entropy_bonus_raises_the_entropy(small_checkpoints, tmp_path):
    """Two iterations from the same first rollout (the same seed): after one update with a large bonus (c = 1)
    the second rollout's entropy per token (objective/entropy over objective/completion_length) is higher than
    after one without. A bonus of the wrong sign lowers it."""
    per_token = {}
    for coef in ("0", "1"):
        run_in_process("scale/grpo.py", *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), "--num-iterations",
                       "2", "--batch-size", "32", "--num-generations", "4", "--mini-batch-size", "16", "--beta", "0",
                       "--lr", "1e-3", "--no-anneal-lr", "--eval-size", "0", "--entropy-coef", coef, "--output-dir",
                       f"out{coef}", "--exp-name", f"c{coef}", cwd=tmp_path)
        (run,) = (tmp_path / "runs").glob(f"c{coef}__*")
        scalars = read_scalars(str(run))
        per_token[coef] = [e / n for (_, e), (_, n) in zip(scalars["objective/entropy"],
                                                          scalars["objective/completion_length"])]
    assert per_token["1"][0] == per_token["0"][0] and per_token["1"][1] > per_token["0"][1] + 0.2, per_token


# ------------------------------------------------------------------------ the selection rules at their boundaries
def test_the_selection_rules_at_their_boundaries():
    """scale/grpo.py's rules where ≥ and > part, where a count is floored, and where padding could enter a statistic:
    the 80/20 mask keeps a token whose entropy is the quantile itself (entropies 1, 2, 3, ρ = 0.5: the median 2 is
    kept; with > it would not be), and a padded token's entropy (9) does not move the quantile; Clip-Cov takes the
    covariances strictly inside its bounds (1 and 5 themselves are out) and at least one token (r·N = 0.03);
    KL-Cov at least one, the largest; DPPO keeps a token whose divergence is δ itself (|0.5 − 0.25| = δ_high
    0.25) and puts Â = 0 on the side of the negative (a fall past δ_low is dropped); VESPO gives Â = 0 the
    positive constants; the adaptive coefficient rises when the entropy equals the target."""
    g = scale_grpo
    entropy, ones = torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3)
    assert g.high_entropy_mask(entropy, ones, 0.5).tolist() == [[False, True, True]]
    padded = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    assert g.high_entropy_mask(padded, torch.tensor([[1.0, 1, 1, 0]]), 0.5).tolist() == [[False, True, True, False]]
    covariance, none_cut = torch.tensor([[1.0, 5.0, 3.0]]), torch.zeros(1, 3, dtype=torch.bool)
    assert g.clip_cov_tokens(covariance, ones, none_cut, 1.0, 1.0, 5.0).tolist() == [[False, False, True]]
    torch.manual_seed(0)
    assert g.clip_cov_tokens(torch.tensor([[2.0, 3.0, 4.0]]), ones, none_cut, 0.01, 1.0, 5.0).sum() == 1
    assert g.kl_cov_tokens(torch.tensor([[2.0, 4.0, 3.0]]), ones, 1e-6).tolist() == [[False, True, False]]
    logprobs, sampler = torch.tensor([[0.5, 0.1]]).log(), torch.tensor([[0.25, 0.5]]).log()
    assert g.dppo_trust_region(logprobs, sampler, torch.tensor([1.0]), "binary_tv", 0.2, 0.25).tolist() == [[1.0, 1.0]]
    assert g.dppo_trust_region(logprobs, sampler, torch.tensor([0.0]), "binary_tv", 0.2, 0.25).tolist() == [[1.0, 0.0]]
    log_ratio, mask = torch.tensor([[0.1, 0.2]]), torch.ones(1, 2)
    zero = g.vespo_weights(log_ratio, mask, torch.tensor([0.0]), None, 2.0, 3.0, 3.0, 2.0)
    assert zero.item() == pytest.approx(math.exp(3 + 0.6 - 3 * math.exp(0.3)), rel=1e-5)  # k_pos 2, λ_pos 3
    assert g.adaptive_entropy_coef(0.01, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)


def test_maxrl_and_batch_scaling_leave_the_unscored_out():
    """MaxRL over a group with an unscored completion: rewards 1, NaN, 0, 0 have the scored mean 1/3, so Â = 2, 0
    (unscored), −1, −1; batch scaling's std is over the scored seven of 1, NaN, 0, 0 | 1, 1, 0, 0 (mean 3/7,
    variance (4 · (4/7)² · ... ) by hand below), not eight with a zero."""
    rewards = torch.tensor([1.0, math.nan, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(scale_grpo.compute_advantages(rewards, 4, "maxrl", "group")[:4],
                               torch.tensor([2.0, 0.0, -1.0, -1.0]), rtol=1e-5, atol=1e-5)
    scored = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    mean = sum(scored) / 7
    std = math.sqrt(sum((x - mean) ** 2 for x in scored) / 6)
    expected = torch.tensor([1 - 1 / 3, 0.0, -1 / 3, -1 / 3, 0.5, 0.5, -0.5, -0.5]) / (std + 1e-4)
    torch.testing.assert_close(scale_grpo.compute_advantages(rewards, 4, "grpo", "batch"), expected)


def test_each_scale_flag_off_changes_nothing():
    """grpo_token_losses with every 2026 and off-policy flag at its off value (--top-entropy-quantile 1, no
    --cov-method, no --off-policy-mask-threshold, no sampler correction) is the loss type's own per-token loss,
    bitwise, and counts nothing; the entropy control off adds no bonus. At ρ = 1 against each one on, the same
    inputs give another loss (the test can tell)."""
    from types import SimpleNamespace

    g = scale_grpo
    torch.manual_seed(3)
    logprobs = -torch.rand(4, 3) * 2
    old = SimpleNamespace(logprobs=logprobs - 0.1 * torch.randn(4, 3), is_weights=None)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    batch = SimpleNamespace(mask=mask, loss_mask=mask, sampler_logprobs=logprobs + 0.3)  # π_θ below the sampler
    advantages, mb, entropy = torch.tensor([1.0, -0.5, 2.0, -1.5]), torch.arange(4), torch.rand(4, 3)
    ratio = (logprobs - old.logprobs).exp()
    for loss_type in ("grpo", "dapo", "cispo"):
        args = g.Args(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None)
        losses, counts = g.grpo_token_losses(ratio, logprobs, entropy, advantages, batch, old, mb, args.epsilon_high or 0.2,
                                             args)
        assert torch.equal(losses, g.token_losses(ratio, logprobs, advantages, loss_type, 0.2,
                                                  args.epsilon_high or 0.2)), loss_type
        assert all(float(counts[k]) == 0 for k in ("off_policy_masked", "dppo_masked", "cov_selected"))
    control = g.EntropyControl(g.Args())
    assert not control.on and control.bonus(entropy, mask, {}).item() == 0.0
    plain = g.grpo_token_losses(ratio, logprobs, entropy, advantages, batch, old, mb, 0.2, g.Args())[0]
    for on in ({"top_entropy_quantile": 0.5}, {"cov_method": "kl_cov", "kl_cov_ratio": 0.3},
               {"off_policy_mask_threshold": 0.0}):
        torch.manual_seed(0)
        changed = g.grpo_token_losses(ratio, logprobs, entropy, advantages, batch, old, mb, 0.2, g.Args(**on))[0]
        assert not torch.equal(changed * mask, plain * mask), on
