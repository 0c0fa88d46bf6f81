"""rlhf_ppo.py: the math against hand-computed values, then the script end to end."""
import math
import os
from types import SimpleNamespace

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
    reward_model_for,
    run_in_process,
    run_script,
    same_seed_scalars,
    split_rows,
)
from lm_models import PositionLogits, by_hand

import rlhf_ppo
from scale import rlhf_ppo as scale_rlhf_ppo

T = torch.tensor


def test_shaped_rewards_score_at_the_last_token_and_padding_after_it():
    # β = 0.1; row 1 is a full response (no padding), row 2 ends with EOS at t = 1, padding at t = 2.
    #   log π − log π_ref:  row 1 (0.5, 0, 0.5);  row 2 (−0.5, 0, [2 on padding])
    #   −β·diff:            row 1 (−0.05, 0, −0.05);  row 2 (0.05, 0, 0)
    #   + score at the last valid token: row 1 t = 2: −0.05 + 2 = 1.95;  row 2 t = 1: 0 − 1 = −1
    logprobs, ref_logprobs = T([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]]), T([[-1.5, -2.0, -1.0], [-0.5, -1.0, -3.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    rewards, non_score = rlhf_ppo.shaped_rewards(logprobs, ref_logprobs, T([2.0, -1.0]), mask, 0.1)
    torch.testing.assert_close(rewards, T([[-0.05, 0.0, 1.95], [0.05, -1.0, 0.0]]))
    torch.testing.assert_close(non_score, T([[-0.05, 0.0, -0.05], [0.05, 0.0, 0.0]]))


def test_masked_gae_over_a_padded_response():
    # γ = 1, λ = 0.5.  Row 2 ends at t = 1; its padding has value 9 and must not count.
    #   row 1, r = (0, 0, 1), V = (.5, .5, .5):
    #     t=2: δ = 1 + 0 − .5 = .5              Â = .5
    #     t=1: δ = 0 + .5 − .5 = 0              Â = 0 + .5·.5 = .25
    #     t=0: δ = 0                            Â = .5·.25 = .125      returns Â + V = .625, .75, 1
    #   row 2, r = (0, 1, pad), V = (.2, .4, pad):
    #     t=1: δ = 1 + 0 − .4 = .6 (V after the end is 0)   Â = .6
    #     t=0: δ = 0 + .4 − .2 = .2             Â = .2 + .5·.6 = .5     returns .7, 1, 0
    rewards, values = T([[0.0, 0, 1], [0, 1, 0]]), T([[0.5, 0.5, 0.5], [0.2, 0.4, 9.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    advantages, returns = rlhf_ppo.masked_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, T([[0.125, 0.25, 0.5], [0.5, 0.6, 0.0]]))
    torch.testing.assert_close(returns, T([[0.625, 0.75, 1.0], [0.7, 1.0, 0.0]]))


def test_masked_gae_with_gamma_unequal_to_lambda():
    # γ = 0.9, λ = 0.5; a response of 3 valid tokens and one of padding; r = 1, 2, 3, V = 1, 1, 1, and V = 0 after
    # the last valid token:
    #   t=2: δ = 3 + .9·0 − 1 = 2        Â_2 = 2
    #   t=1: δ = 2 + .9·1 − 1 = 1.9      Â_1 = 1.9 + .9·.5·2 = 2.8
    #   t=0: δ = 1 + .9·1 − 1 = 0.9      Â_0 = 0.9 + .45·2.8 = 2.16;  returns = Â + V = 3.16, 3.8, 3, (padding) 0
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    advantages, returns = rlhf_ppo.masked_gae(torch.tensor([[1.0, 2.0, 3.0, 5.0]]), torch.tensor([[1.0, 1.0, 1.0, 7.0]]),
                                              mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[2.16, 2.8, 2.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[3.16, 3.8, 3.0, 0.0]]))


def test_masked_whiten():
    # valid values {1, 2, 3, 5}: mean 2.75, var (1.75² + .75² + .25² + 2.25²)/4 = 8.75/4 = 2.1875, std 1.479020
    #   (1 − 2.75)/1.47902 = −1.183216, (2 − 2.75)/… = −0.507093, (3 − 2.75)/… = 0.169031, (5 − 2.75)/… = 1.521278
    x, mask = T([[1.0, 2, 3], [5, 100, 100]]), T([[1.0, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(rlhf_ppo.masked_whiten(x, mask),
                               T([[-1.183216, -0.507093, 0.169031], [1.521278, 0, 0]]), atol=1e-5, rtol=0)


def test_kl_estimators_k1_and_k3():
    # log r = log π_ref − log π = (−0.5, 1) and a padded token
    #   k1 = −log r = (0.5, −1);  k3 = e^{log r} − 1 − log r = (e^−.5 − .5 = 0.106531, e − 2 = 0.718282)
    k1, k3 = rlhf_ppo.kl_estimators(T([[-1.0, -2.0, -1.0]]), T([[-1.5, -1.0, -9.0]]), T([[1.0, 1, 0]]))
    torch.testing.assert_close(k1, T([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(k3, T([[0.106531, 0.718282, 0.0]]), atol=1e-6, rtol=0)


def test_policy_and_value_losses_average_over_valid_tokens():
    # ratios (1.5, 0.5, 1) with Â = (1, 1, 100), the third token padding; ε = 0.2:
    #   max(−1.5, −1.2) = −1.2;  max(−0.5, −0.8) = −0.5;  mean over the 2 valid tokens = −0.85
    mask = T([[1.0, 1, 0]])
    loss, ratio = rlhf_ppo.policy_loss(T([[math.log(1.5), math.log(0.5), 0.0]]), T([[0.0, 0.0, 0.0]]),
                                       T([[1.0, 1.0, 100.0]]), mask, 0.2)
    assert loss.item() == pytest.approx(-0.85)
    torch.testing.assert_close(ratio, T([[1.5, 0.5, 1.0]]))
    # V = (2, .5), V_old = (1, 1), R = (3, 0), ε = .2: max((2−3)², (1.2−3)²) = 3.24, max(.25, .64) = .64
    #   ½·(3.24 + .64)/2 = 0.97; the padded token (V = 7, R = 0) does not count
    assert rlhf_ppo.masked_value_loss(T([[2.0, 0.5, 7.0]]), T([[1.0, 1.0, 0.0]]), T([[3.0, 0.0, 0.0]]), mask,
                               0.2).item() == pytest.approx(0.97)


BOTH_TIERS = pytest.mark.parametrize("module", [rlhf_ppo, scale_rlhf_ppo], ids=["top", "scale"])
SCALE = pytest.mark.parametrize("module", [scale_rlhf_ppo], ids=["scale"])  # VC-PPO's and VAPO's: scale/ alone


@BOTH_TIERS
def test_the_clip_fraction_counts_the_ratios_out_of_the_band_on_either_side(module):
    # ratios 1.25, 0.75, 1.1 and 0.81 with ε = 0.2: 1.25 > 1.2 and 0.75 < 0.8 are clipped, 1.1 and 0.81 are not: 2/4;
    # over 8 tokens of a whole minibatch (num_tokens) 2/8. The approximate KL ½ (log ρ)², the ratio's mean, alike
    stats = {k: [] for k in ("pg_loss", "vf_loss", "lm_loss", "approx_kl", "clipfrac", "ratio", "entropy")}
    ratio = T([[1.25, 0.75, 1.1, 0.81]])
    flags = SimpleNamespace(cliprange=0.2, cliprange_high=None)
    for num_tokens in (4.0, 8.0):
        module.accumulate_ppo_stats(stats, (T(0.0), T(0.0), T(0.0)), ratio, ratio.log(), torch.ones(1, 4),
                                    torch.ones(1, 4), num_tokens, False, flags)
    assert [float(x) for x in stats["clipfrac"]] == pytest.approx([0.5, 0.25])
    assert float(stats["ratio"][0]) == pytest.approx((1.25 + 0.75 + 1.1 + 0.81) / 4)
    assert float(stats["approx_kl"][1]) == pytest.approx(sum(0.5 * math.log(r) ** 2 for r in (1.25, 0.75, 1.1, 0.81)) / 8)


@SCALE
def test_decoupled_gae_critic_lambda_for_the_targets_actor_lambda_for_the_advantages(module):
    # γ = 0.9, r = 1, 2, 3, V = 1, 1, 1 and padding (V = 0 after the last valid token): δ = 0.9, 1.9, 2
    #   actor λ = 0.5:  Â_2 = 2, Â_1 = 1.9 + .45·2 = 2.8, Â_0 = 0.9 + .45·2.8 = 2.16
    #   critic λ = 1:   the Monte Carlo returns G_2 = 3, G_1 = 2 + .9·3 = 4.7, G_0 = 1 + .9·4.7 = 5.23
    rewards, values, mask = T([[1.0, 2.0, 3.0, 5.0]]), T([[1.0, 1.0, 1.0, 7.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    advantages, returns = module.decoupled_gae(rewards, values, mask, 0.9, 0.5, 1.0)  # actor λ, critic λ
    torch.testing.assert_close(advantages, T([[2.16, 2.8, 2.0, 0.0]]))
    torch.testing.assert_close(returns, T([[5.23, 4.7, 3.0, 0.0]]))
    # one λ: masked_gae's own pair (returns Â + V = 3.16, 3.8, 3)
    advantages, returns = module.decoupled_gae(rewards, values, mask, 0.9, 0.5, 0.5)
    torch.testing.assert_close(returns, T([[3.16, 3.8, 3.0, 0.0]]))


@SCALE
def test_masked_gae_with_one_lambda_per_response(module):
    # γ = 1; row 1 r = (0, 0, 1), V = (.5, .5, .5), λ = .5: Â = .125, .25, .5 (test_masked_gae_over_a_padded_response)
    #        row 2 r = (0, 1, pad), V = (.2, .4, pad), λ = 0: Â = δ = (0 + .4 − .2, 1 + 0 − .4) = .2, .6
    rewards, values = T([[0.0, 0, 1], [0, 1, 0]]), T([[0.5, 0.5, 0.5], [0.2, 0.4, 9.0]])
    advantages, returns = module.masked_gae(rewards, values, T([[1.0, 1, 1], [1, 1, 0]]), 1.0, T([0.5, 0.0]))
    torch.testing.assert_close(advantages, T([[0.125, 0.25, 0.5], [0.2, 0.6, 0.0]]))
    torch.testing.assert_close(returns, T([[0.625, 0.75, 1.0], [0.4, 1.0, 0.0]]))


@SCALE
def test_length_adaptive_lambda(module):
    # α = 0.5: l = 10: 1 − 1/5 = 0.8;  l = 4: 1 − 1/2 = 0.5;  l = 1: 1 − 2 < 0, so 0;  α = 0.25, l = 10: 1 − 1/2.5 = 0.6
    mask = T([[1.0] * 10, [1.0] * 4 + [0.0] * 6, [1.0] + [0.0] * 9])
    torch.testing.assert_close(module.length_adaptive_lam(mask, 0.5), T([0.8, 0.5, 0.0]))
    torch.testing.assert_close(module.length_adaptive_lam(mask[:1], 0.25), T([0.6]))


@SCALE
def test_positive_lm_loss_is_the_nll_of_the_responses_that_pass(module):
    # rows 1 and 3 pass: −(−1 − 2) − (−3 − 1 − 1) = 8 over their 5 tokens = 1.6 (row 2, which does not pass, would
    # make it 8.5 / 6; the padding's −9 would count too); over 10 tokens of a whole minibatch 0.8; none passes: 0
    logprobs = T([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0], [-3.0, -1.0, -1.0]])
    mask, positive = T([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]]), T([True, False, True])
    assert module.positive_lm_loss(logprobs, mask, positive).item() == pytest.approx(1.6)
    assert module.positive_lm_loss(logprobs, mask, positive, 10.0).item() == pytest.approx(0.8)
    assert module.positive_lm_loss(logprobs, mask, T([False, False, False])).item() == 0.0


@SCALE
def test_clip_higher_in_the_policy_loss_and_the_clip_fraction(module):
    # ratios (1.5, 0.5), Â = (1, −1), ε = 0.2, ε_high = 0.28: max(−1.5, −1.28) = −1.28, max(.5, .8) = .8: mean −0.24
    #   (ε_high = ε: −1.2 and .8, −0.2)
    args = (T([[math.log(1.5), math.log(0.5)]]), T([[0.0, 0.0]]), T([[1.0, -1.0]]), T([[1.0, 1.0]]), 0.2)
    assert module.policy_loss(*args, cliprange_high=0.28)[0].item() == pytest.approx(-0.24)
    assert module.policy_loss(*args)[0].item() == pytest.approx(-0.2)
    # the clip fraction: ratios 1.25, 0.75, 1.1; 0.75 < 1 − 0.2 only (1.25 ≤ 1.28): 1/3; with ε_high = ε also 1.25
    stats = {k: [] for k in ("pg_loss", "vf_loss", "lm_loss", "approx_kl", "clipfrac", "ratio", "entropy")}
    ratio = T([[1.25, 0.75, 1.1]])
    for high in (0.28, None):
        module.accumulate_ppo_stats(stats, (T(0.0), T(0.0), T(0.0)), ratio, ratio.log(), torch.zeros(1, 3),
                                    torch.ones(1, 3), 3.0, False, SimpleNamespace(cliprange=0.2, cliprange_high=high))
    assert [float(x) for x in stats["clipfrac"]] == pytest.approx([1 / 3, 2 / 3])


@pytest.mark.parametrize("script", ["scale/rlhf_ppo.py"])
@pytest.mark.parametrize("flags,words", [
    (["--length-adaptive-lam", "0.05", "--actor-lam", "0.9"], ["--length-adaptive-lam 0.05", "leave out --actor-lam"]),
    (["--value-warmup-steps", "3", "--vf-coef", "0"], ["--value-warmup-steps 3", "--vf-coef 0", "train nothing"]),
    (["--positive-lm-coef", "0.1", "--dataset-name", "p.jsonl"], ["--positive-lm-coef 0.1", "--reward-fn"]),
])
def test_vapo_flags_that_contradict_or_train_nothing_are_one_line(script, flags, words, tmp_path):
    message = one_line_exit(script, "--model-name-or-path", "models/none", *flags, cwd=tmp_path)
    assert all(word in message for word in words), message
    assert not os.listdir(tmp_path)


def test_adaptive_kl_controller_step():
    # β = 0.1, target 4, horizon 10000, 128 responses:
    #   KL 6:   e = clip(6/4 − 1, ±.2) = .2     β = .1 · (1 + .2 · 128/10000) = 0.100256
    #   KL 3.8: e = 3.8/4 − 1 = −.05            β = .1 · (1 − .05 · 128/10000) = 0.099936
    assert rlhf_ppo.adaptive_kl_coef(0.1, 6.0, 4.0, 10_000, 128) == pytest.approx(0.100256)
    assert rlhf_ppo.adaptive_kl_coef(0.1, 3.8, 4.0, 10_000, 128) == pytest.approx(0.099936)


PPO_TINY = ["--num-iterations", "2", "--batch-size", "16", "--mini-batch-size", "8", "--ppo-epochs", "2",
            "--eval-size", "16", "--eval-every", "1"]


def test_rlhf_ppo_smoke_and_first_ratio_is_exactly_one(tiny_checkpoints, tmp_path):
    cwd = tmp_path
    run_in_process("rlhf_ppo.py", *PPO_TINY, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), cwd=cwd)
    run_dir = sorted((cwd / "runs").glob("rlhf_ppo__*"))[-1]
    scalars = read_scalars(str(run_dir))
    for tag in ["objective/score", "objective/kl", "objective/kl_k3", "objective/entropy", "objective/non_score_reward",
                "objective/rlhf_reward", "policy/approx_kl", "policy/clipfrac", "policy/ratio_mean", "policy/entropy",
                "losses/policy_loss", "losses/value_loss", "val/explained_variance", "val/num_eos", "charts/kl_coef",
                "eval/gold_accuracy", "eval/gold_score", "eval/score", "eval/kl"]:
        assert tag in scalars, tag
    # the rollout's log-probs and the first minibatch's are computed identically: ratio exactly 1
    assert [v for _, v in scalars["policy/first_ratio_max_error"]] == [0.0, 0.0]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(cwd / "models" / "rlhf_ppo")


def test_rlhf_ppo_adaptive_kl_moves_the_coefficient(tiny_checkpoints, tmp_path):
    cwd = tmp_path
    run_in_process("rlhf_ppo.py", *PPO_TINY, "--kl-coef", "0.05", "--kl-target", "0.001", "--kl-horizon", "100",
                   "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), "--output-dir", "models/ppo_kl", cwd=cwd)
    scalars = read_scalars(str(sorted((cwd / "runs").glob("rlhf_ppo__*"))[-1]))
    kl_coefs = [v for _, v in scalars["charts/kl_coef"]]
    kls = [v for _, v in scalars["objective/kl"]]
    assert kl_coefs[0] == pytest.approx(0.05)
    assert kl_coefs[1] == pytest.approx(rlhf_ppo.adaptive_kl_coef(0.05, kls[0], 0.001, 100, 16), rel=1e-5)


def test_bad_input_says_which_script_to_run_first(tiny_checkpoints, tmp_path):
    assert_one_line_error(run_script("rlhf_ppo.py", cwd=tmp_path, check=False), "models/sft", "python sft.py")
    message = one_line_exit("rlhf_ppo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), cwd=tmp_path)
    assert "models/reward_model" in message and "python reward_model.py" in message
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "models")


def test_real_data_paths_with_local_files(tiny_checkpoints, tmp_path, monkeypatch):
    """TRL's prompt-only format, as a local .jsonl file. --max-prompt-length 12 drops the prompts longer than 12
    tokens, two thirds of them: none is sampled from (a script that reads the flag at its default, 64, samples them)."""
    import json

    lengths, real = [], rlhf_ppo.generate

    def spy(model, prompt_ids, *args, **kwargs):
        lengths.extend(len(p) for p in prompt_ids)
        return real(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(rlhf_ppo, "generate", spy)
    # 9-11, 13-15 or 17-19 bytes, one token each (the tiny model's tokenizer is byte-level)
    prompts = [f"sort {i}{i + 3}1{'9' * (4 * (i % 3))}:" for i in range(60)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    train = [row["prompt"] for row in split_rows(tmp_path / "prompts.jsonl")[0]]  # 6 held out
    assert sum(len(p.encode()) <= 12 for p in train) >= 16  # batches of 16
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("rlhf_ppo.py", *PPO_TINY, "--dataset-name", "prompts.jsonl", "--model-name-or-path", str(models / "sft"),
                   "--reward-model-path", reward_model_for(models / "reward_model", tmp_path / "rm", "prefs.jsonl"),
                   "--max-prompt-length", "12",
                   "--output-dir", "ppo", cwd=tmp_path)
    assert len(lengths) > 32 and max(lengths) <= 12, lengths  # two rollouts of 16, and the evaluations
    scalars = read_scalars(str(sorted(tmp_path.glob("runs/rlhf_ppo__*"))[-1]))
    assert "eval/kl" in scalars and "eval/score" in scalars and "eval/gold_accuracy" not in scalars
    assert (tmp_path / "ppo" / "config.json").exists()


def test_policy_logprobs_are_those_of_the_token_after_each_position():
    model = PositionLogits()
    sequences = torch.tensor([[0, 3, 4, 5, 6, 2], [0, 0, 7, 1, 9, 8]])  # context 3 (row 1 left-padded), response 3
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    logits = model(sequences).logits
    expected = by_hand(logits, sequences, [(b, p) for b in range(2) for p in range(3, 6)]).view(2, 3)
    torch.testing.assert_close(rlhf_ppo.policy_logprobs(model, sequences, attention_mask, 3, 1.0)[0], expected)
    torch.testing.assert_close(scale_rlhf_ppo.policy_logprobs(model, sequences, attention_mask, 3, 1.0)[0], expected)


def test_same_seed_same_logs_and_weights(tiny_checkpoints, tmp_path):
    models = tiny_checkpoints["cwd"] / "models"
    flags = [*PPO_TINY, "--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
             "--output-dir", "models/m"]
    (logs_a, saved_a), (logs_b, saved_b) = same_seed_scalars("rlhf_ppo.py", flags, tmp_path)
    assert [tag for tag in logs_a if logs_a[tag] != logs_b.get(tag)] == [] and len(logs_a) >= 5
    assert saved_a == saved_b and len(saved_a) == 1


# ------------------------------------------------------------------------ the direction of one update
def test_one_step_raises_the_surrogate_and_lowers_the_critic_error(tiny_checkpoints, tmp_path, monkeypatch):
    """The direction of the update: one step (β = 0, a small learning rate) on one rollout raises PPO's surrogate
    mean_t Â_t · π_θ(a_t|s_t) / π_old(a_t|s_t) over its response tokens and lowers the critic's squared error to
    the returns. Advantages and returns are computed here: the reward model's score at the stop token (−3 without
    one), values from the reward model's head at every position (the critic starts as the reward model), GAE with
    γ = 1, λ = 0.95, whitened over the batch. A policy or value loss of the wrong sign fails it."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    calls, real_sample, loaded = [], rlhf_ppo.generate, []
    real_load = rlhf_ppo.load_models

    def recording(*args, **kwargs):
        calls.append(real_sample(*args, **kwargs))
        return calls[-1]

    def loading(*args):
        loaded.append(real_load(*args))  # (tokenizer, stop_ids, actor, reference, reward model, critic)
        return loaded[-1]

    monkeypatch.setattr(rlhf_ppo, "generate", recording)
    monkeypatch.setattr(rlhf_ppo, "load_models", loading)
    sft_path, rm_path = tiny_checkpoints["sft"], tiny_checkpoints["reward_model"]
    run_in_process("rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(sft_path), "--reward-model-path", str(rm_path),
                   "--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "8", "--ppo-epochs", "1",
                   "--kl-coef", "0", "--lr", "1e-4", "--eval-size", "4", "--output-dir", "out", cwd=tmp_path)
    sequences, attention_mask, width, mask, _ = next(call for call in calls if len(call[0]) == 8)
    mask = mask.float()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    def per_position_values(classifier):
        with torch.no_grad():
            hidden = classifier.transformer(input_ids=sequences, attention_mask=attention_mask,
                                            position_ids=positions).last_hidden_state
            return classifier.score(hidden.float()).squeeze(-1)

    def token_logprobs(path):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).logits.float()
        return torch.log_softmax(logits[:, width - 1 : -1], -1).gather(-1, sequences[:, width:, None]).squeeze(-1)

    start = per_position_values(AutoModelForSequenceClassification.from_pretrained(rm_path).eval())
    last = mask.sum(1).long() - 1  # each response's last token: its stop token, if it has one
    stopped = ((sequences[:, width:] == 1) & mask.bool()).any(1)  # ByT5's EOS
    scores = torch.where(stopped, start[:, width:][torch.arange(8), last], torch.tensor(-3.0))
    values = start[:, width - 1 : -1] * mask
    advantages, next_advantage = torch.zeros_like(values), torch.zeros(8)
    for t in reversed(range(values.shape[1])):
        reward = torch.where(t == last, scores, torch.zeros(8))
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros(8)
        next_advantage = (reward + next_value - values[:, t]) + 0.95 * next_advantage
        advantages[:, t] = next_advantage * mask[:, t]
        next_advantage = next_advantage * mask[:, t]
    returns = advantages + values
    mean = (advantages * mask).sum() / mask.sum()
    whitened = (advantages - mean) / (((advantages - mean) ** 2 * mask).sum() / mask.sum()).sqrt() * mask
    assert whitened.abs().sum() > 0
    ratio = (token_logprobs(tmp_path / "out") - token_logprobs(sft_path)).exp()
    assert ((whitened * (ratio - 1)) * mask).sum() / mask.sum() > 1e-6
    critic = loaded[0][5]  # the trained critic, as the run left it
    error = lambda v: (((v[:, width - 1 : -1] - returns) ** 2) * mask).sum()  # noqa: E731
    assert error(per_position_values(critic.eval())) < error(start) - 1e-6


def test_the_advantages_that_reach_the_loss_are_whitened_gae_of_the_rollout(tiny_checkpoints, tmp_path, monkeypatch):
    """main hands GAE its flags: with γ = 0.9 ≠ λ = 0.5 the advantages the policy loss receives are GAE of the
    recorded per-token rewards and values, Â_t = Σ_k (γλ)^k δ_{t+k} summed out by hand over each response, then
    whitened over the batch's response tokens."""
    rollout, received = {}, []
    real_gae, real_loss = rlhf_ppo.masked_gae, rlhf_ppo.policy_loss

    def gae_spy(rewards, values, mask, gamma, lam):
        rollout.setdefault("inputs", (rewards.clone(), values.clone(), mask.clone()))
        return real_gae(rewards, values, mask, gamma, lam)

    def loss_spy(logprobs, old_logprobs, advantages, *rest):
        received.append(advantages.detach().clone())
        return real_loss(logprobs, old_logprobs, advantages, *rest)

    monkeypatch.setattr(rlhf_ppo, "masked_gae", gae_spy)
    monkeypatch.setattr(rlhf_ppo, "policy_loss", loss_spy)
    run_in_process("rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), "--num-iterations", "1", "--batch-size", "8",
                   "--mini-batch-size", "8", "--ppo-epochs", "1", "--gamma", "0.9", "--lam", "0.5", "--eval-size", "4",
                   "--output-dir", "out", cwd=tmp_path)
    rewards, values, mask = (x.double() for x in rollout["inputs"])
    by_hand = torch.zeros_like(rewards)
    for i in range(len(rewards)):
        n = int(mask[i].sum())  # the response's tokens; V = 0 after its last
        v = torch.cat([values[i, :n], torch.zeros(1, dtype=torch.float64)])
        deltas = [rewards[i, s] + 0.9 * v[s + 1] - v[s] for s in range(n)]
        for t in range(n):
            by_hand[i, t] = sum((0.9 * 0.5) ** k * deltas[t + k] for k in range(n - t))
    mean = by_hand[mask.bool()].mean()
    whitened = (by_hand - mean) / by_hand[mask.bool()].var(unbiased=False).sqrt() * mask
    assert len(received) == 1 and received[0].shape == mask.shape
    torch.testing.assert_close(received[0].double() * mask, whitened, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reference_stays_the_starting_model(tiny_checkpoints, tmp_path, monkeypatch, lora):
    """KL 0 before the first update; after training the reference computes the SFT model's logits exactly (with
    LoRA: the policy itself, its adapters off) while the policy has moved away from it (KL > 0)."""
    if lora:
        pytest.importorskip("peft")
    sft = tiny_checkpoints["sft"]
    flags = ["--model-name-or-path", str(sft), "--reward-model-path", str(tiny_checkpoints["reward_model"]),
                  "--num-iterations", "2", "--batch-size", "8", "--mini-batch-size", "8", "--eval-size", "8", "--eval-every", "2", "--output-dir", "out", *(["--lora-r", "4"] if lora else [])]
    scalars, reference = reference_after_training("scale/rlhf_ppo.py" if lora else "rlhf_ppo.py", flags, tmp_path,
                                                  monkeypatch)
    assert_the_reference_stayed(sft, tmp_path / "out", reference, scalars)


def test_it_raises_the_reward_in_10_iterations(small_checkpoints, tmp_path):
    """From the small SFT and reward models, 10 iterations of 32 prompts: the held-out reward rises by 0.10, 0.33 and
    0.21 (seeds 1-3, from the small models the top-level sft.py and reward_model.py make; 0.27-0.37 from those of the
    scripts before the split, which compute the same to rounding: the 10 iterations amplify it), at least 0.05; with
    the policy loss's sign flipped it falls by 2.5."""
    run_in_process("rlhf_ppo.py", "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-model-path",
                   str(small_checkpoints["reward_model"]), "--num-iterations", "10", "--batch-size", "32",
                   "--mini-batch-size", "16", "--eval-every", "10", "--eval-size", "64", "--output-dir", "out", cwd=tmp_path)
    reward = [v for _, v in read_scalars(only_run_dir(tmp_path))["eval/reward"]]
    assert reward[-1] > reward[0] + 0.05, reward


@pytest.mark.parametrize("source", ["reward_model", "gold"])
def test_a_response_with_no_stop_token_is_scored_the_missing_eos_penalty(small_checkpoints, tmp_path, monkeypatch,
                                                                        source):
    """The scores shaped_rewards receives: --missing-eos-penalty (−7.5 here, a value no reward gives) for each response
    with no stop token in its 6 tokens (a sorted 4-6 digits and EOS take 5-7), and for the others the reward model's
    score at the stop token, computed here from the reward model by hand, or the gold score, in [0, 1]
    (--reward-fn gold). A rollout without the penalty scores unfinished answers."""
    from transformers import AutoModelForSequenceClassification

    calls, received = [], []
    real_sample, real_shaped = rlhf_ppo.generate, rlhf_ppo.shaped_rewards

    def recording(*args, **kwargs):
        calls.append(real_sample(*args, **kwargs))
        return calls[-1]

    def shaped_spy(logprobs, ref_logprobs, scores, mask, kl_coef):
        received.append(scores.clone())
        return real_shaped(logprobs, ref_logprobs, scores, mask, kl_coef)

    monkeypatch.setattr(rlhf_ppo, "generate", recording)
    monkeypatch.setattr(rlhf_ppo, "shaped_rewards", shaped_spy)
    rm_path = small_checkpoints["reward_model"]
    score = ["--reward-model-path", str(rm_path)] if source == "reward_model" else ["--reward-fn", "gold", "--reward-model-path", "None"]
    run_in_process("rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), *score,
                   "--num-iterations", "1", "--batch-size", "16", "--mini-batch-size", "16", "--ppo-epochs", "1",
                   "--response-length", "6", "--missing-eos-penalty", "-7.5", "--eval-size", "4", "--output-dir", "out",
                   cwd=tmp_path)
    sequences, attention_mask, width, mask, _ = next(call for call in calls if len(call[0]) == 16)
    stopped = ((sequences[:, width:] == 1) & mask.bool()).any(1)  # ByT5's EOS
    assert stopped.any() and not stopped.all(), stopped  # both kinds in the rollout
    (scores,) = received
    assert (scores[~stopped] == -7.5).all(), scores
    if source == "gold":
        assert ((scores[stopped] >= 0) & (scores[stopped] <= 1)).all(), scores
        return
    reward = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = reward.transformer(input_ids=sequences, attention_mask=attention_mask,
                                    position_ids=positions).last_hidden_state
        at_stop = reward.score(hidden[torch.arange(16), width + mask.sum(1) - 1]).squeeze(-1)
    torch.testing.assert_close(scores[stopped], at_stop[stopped], atol=1e-5, rtol=0)


@pytest.mark.parametrize("vf_coef,critic_grad", [(0.0, False), (0.5, True)])
def test_the_ppo_flags_reach_the_losses_and_the_gradient(tiny_checkpoints, tmp_path, monkeypatch, vf_coef, critic_grad):
    """--kl-coef reaches the per-token rewards (shaped_rewards), --cliprange the policy loss, --cliprange-value the
    value loss, at every minibatch of every one of the --ppo-epochs; --temperature 0.7 reaches the sampling (the
    rollout's and the evaluation's) and the log-probs, so the first minibatch's ratio is exactly 1; and with the
    policy loss zeroed (0 × itself, still in the graph) the critic's gradient is vf_coef · L^V's: none at --vf-coef 0,
    some at 0.5. A loop that ignores one of them fails."""
    seen = {"kl_coef": [], "cliprange": [], "cliprange_value": [], "critic_grad": [], "temperature": []}
    real = {name: getattr(rlhf_ppo, name) for name in ("shaped_rewards", "policy_loss", "masked_value_loss", "load_models",
                                                      "generate")}
    critics, real_clip = [], torch.nn.utils.clip_grad_norm_

    def shaped_spy(logprobs, ref_logprobs, scores, mask, kl_coef):
        seen["kl_coef"].append(kl_coef)
        return real["shaped_rewards"](logprobs, ref_logprobs, scores, mask, kl_coef)

    def policy_spy(new_logprobs, logprobs, advantages, mask, cliprange, num_tokens):
        seen["cliprange"].append(cliprange)
        pg_loss, ratio = real["policy_loss"](new_logprobs, logprobs, advantages, mask, cliprange, num_tokens)
        if len(seen["cliprange"]) == 1:  # before any step: the rollout's log-probs, at the same --temperature
            assert torch.equal(ratio * mask, mask)
        return 0 * pg_loss, ratio

    def value_spy(new_values, values, returns, mask, cliprange_value, num_tokens):
        seen["cliprange_value"].append(cliprange_value)
        return real["masked_value_loss"](new_values, values, returns, mask, cliprange_value, num_tokens)

    def generate_spy(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature=1.0, **kwargs):
        seen["temperature"].append(temperature)
        return real["generate"](model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature, **kwargs)

    def load_spy(*args):
        models = real["load_models"](*args)
        critics.append(models[-1])  # (tokenizer, stop_ids, actor, ref, reward, critic)
        return models

    def clip_spy(parameters, *args, **kwargs):
        parameters = list(parameters)
        seen["critic_grad"].append(any(p.grad is not None and bool(p.grad.abs().sum() > 0)
                                       for p in critics[-1].parameters()))
        return real_clip(parameters, *args, **kwargs)

    for name, spy in (("shaped_rewards", shaped_spy), ("policy_loss", policy_spy), ("masked_value_loss", value_spy),
                      ("load_models", load_spy), ("generate", generate_spy)):
        monkeypatch.setattr(rlhf_ppo, name, spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_spy)
    run_in_process("rlhf_ppo.py", "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), "--num-iterations", "1", "--batch-size", "8",
                   "--mini-batch-size", "4", "--ppo-epochs", "2", "--kl-coef", "0.07", "--cliprange", "0.3",
                   "--cliprange-value", "0.25", "--vf-coef", str(vf_coef), "--temperature", "0.7", "--eval-size", "4", "--output-dir", "out",
                   cwd=tmp_path)
    # one rollout; 2 epochs of 2 minibatches each
    assert seen["kl_coef"] == [0.07] and seen["cliprange"] == [0.3] * 4 and seen["cliprange_value"] == [0.25] * 4
    assert seen["critic_grad"] == [critic_grad] * 4
    assert seen["temperature"] == [0.7] * 3  # the evaluation before training, the rollout, the evaluation after it


# ------------------------------------------------------------------------ VC-PPO and VAPO: scale/rlhf_ppo.py's
def test_the_vapo_flags_reach_the_losses_and_the_lm_term_the_gradient(tiny_checkpoints, tmp_path, monkeypatch):
    """scale/rlhf_ppo.py: --critic-lam and --length-adaptive-lam reach decoupled GAE (the critic's λ 1; the actor's one per response,
    1 − 1/(α l) of its length l, by hand), --cliprange-high the policy loss, and --positive-lm-coef the positive-
    example loss, with the update's own log-probs (those the policy loss gets) and as its set T exactly the responses
    every reward function scores 1 (the format here, matched by hand on the rollout's text). With the policy loss
    zeroed (0 × itself) and --vf-coef 0, the one step left raises the log-likelihood of the responses in T: the term
    reaches the gradient, with its sign."""
    import json
    import re

    seen = {"gae": [], "rollout": [], "policy": [], "lm": []}
    real = {name: getattr(scale_rlhf_ppo, name) for name in ("decoupled_gae", "score_rollout", "policy_loss", "positive_lm_loss")}

    def gae_spy(rewards, values, mask, gamma, actor_lam, critic_lam):
        seen["gae"].append((mask.clone(), actor_lam, critic_lam))
        return real["decoupled_gae"](rewards, values, mask, gamma, actor_lam, critic_lam)

    def rollout_spy(*args):
        seen["rollout"].append(real["score_rollout"](*args))
        return seen["rollout"][-1]

    def policy_spy(new_logprobs, *args):
        seen["policy"].append((new_logprobs, args[-1]))  # args[-1]: cliprange_high
        pg_loss, ratio = real["policy_loss"](new_logprobs, *args)
        return 0 * pg_loss, ratio

    def lm_spy(logprobs, mask, positive, *rest):
        seen["lm"].append((logprobs, positive.clone()))
        return real["positive_lm_loss"](logprobs, mask, positive, *rest)

    for name, spy in (("decoupled_gae", gae_spy), ("score_rollout", rollout_spy), ("policy_loss", policy_spy),
                      ("positive_lm_loss", lm_spy)):
        monkeypatch.setattr(scale_rlhf_ppo, name, spy)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": f"sort {i % 7}{i % 5}{i % 3}1:"}) for i in range(40)))
    sft = tiny_checkpoints["sft"]
    run_in_process("scale/rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(sft), "--dataset-name", "p.jsonl",
                   "--reward-fn", "format", "--format-pattern", ".*[a-z].*", "--reward-model-path", "None",
                   "--response-length", "12", "--num-iterations", "1", "--batch-size", "8",
                   "--mini-batch-size", "8", "--ppo-epochs", "1", "--lr", "1e-4", "--vf-coef", "0", "--critic-lam", "1.0",
                   "--length-adaptive-lam", "0.4", "--cliprange-high", "0.28", "--positive-lm-coef", "1.0",
                   "--eval-size", "4", "--output-dir", "out", cwd=tmp_path)
    (batch,), ((mask, actor_lam, critic_lam),) = seen["rollout"], seen["gae"]
    lengths = mask.sum(1).tolist()  # the tokens GAE sees
    assert critic_lam == 1.0 and actor_lam.tolist() == pytest.approx([max(0.0, 1 - 1 / (0.4 * n)) for n in lengths])
    passing = [re.fullmatch(".*[a-z].*", c, re.DOTALL) is not None for c in batch.completions]
    assert 0 < sum(passing) < 8, batch.completions  # both kinds in the rollout
    ((new_logprobs, high),), ((lm_logprobs, positive),) = seen["policy"], seen["lm"]
    assert high == 0.28 and lm_logprobs is new_logprobs and positive.tolist() == passing

    def nll_of_passing(path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logprobs, _ = real_policy_logprobs(model, batch.sequences, batch.attention_mask, batch.context_length, 1.0)
        return -(logprobs * batch.mask)[torch.tensor(passing)].sum()

    real_policy_logprobs = scale_rlhf_ppo.policy_logprobs
    assert nll_of_passing(tmp_path / "out") < nll_of_passing(sft) - 1e-4


def test_the_value_warmup_trains_the_critic_alone_towards_monte_carlo_returns(tiny_checkpoints, tmp_path, monkeypatch):
    """scale/rlhf_ppo.py --value-warmup-steps 2: two rollouts before the loop's, at which the value loss gets as its targets the Monte
    Carlo returns, by hand the response's score at each of its tokens (γ = 1, one reward at the last token, and a KL
    penalty of exactly 0: the actor is still the reference); the critic moves and the actor does not; then the loop,
    its GAE at --lam. A warm-up at the loop's λ, or one that moves the actor, fails."""
    seen = {"rollout": [], "value_targets": [], "lams": []}
    real = {name: getattr(scale_rlhf_ppo, name) for name in ("score_rollout", "masked_value_loss", "warm_up_critic",
                                                      "decoupled_gae")}
    moved = {}

    def rollout_spy(*args):
        seen["rollout"].append(real["score_rollout"](*args))
        return seen["rollout"][-1]

    def value_spy(new_values, values, returns, *rest):
        seen["value_targets"].append((len(seen["rollout"]), returns.clone()))
        return real["masked_value_loss"](new_values, values, returns, *rest)

    def warm_up_spy(models, *args):
        pair = (models[0], models[2])  # actor, critic (models[1]: the actor unwrapped)
        before = [{k: v.clone() for k, v in m.state_dict().items()} for m in pair]
        real["warm_up_critic"](models, *args)
        moved.update({name: any(not torch.equal(v, m.state_dict()[k]) for k, v in b.items())
                      for name, m, b in zip(("actor", "critic"), pair, before)})

    def gae_spy(rewards, values, mask, gamma, actor_lam, critic_lam):
        seen["lams"].append((actor_lam, critic_lam))
        return real["decoupled_gae"](rewards, values, mask, gamma, actor_lam, critic_lam)

    for name, spy in (("score_rollout", rollout_spy), ("masked_value_loss", value_spy), ("warm_up_critic", warm_up_spy),
                      ("decoupled_gae", gae_spy)):
        monkeypatch.setattr(scale_rlhf_ppo, name, spy)
    run_in_process("scale/rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path",
                   str(tiny_checkpoints["reward_model"]), "--value-warmup-steps", "2", "--num-iterations", "1",
                   "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "1", "--eval-size", "4",
                   "--output-dir", "out", cwd=tmp_path)
    assert moved == {"actor": False, "critic": True}
    assert len(seen["rollout"]) == 3 and seen["lams"] == [(0.95, 0.95)]  # two warm-up rollouts, then the loop's
    for step in (1, 2):
        batch = seen["rollout"][step - 1]
        # one epoch: its two minibatches are the rollout's rows in order, 0-3 then 4-7
        targets = torch.cat([returns for rollout, returns in seen["value_targets"] if rollout == step])
        by_hand = batch.scores.nan_to_num(0.0)[:, None] * batch.mask
        assert targets.shape == by_hand.shape and batch.mask.sum(1).min() > 1
        torch.testing.assert_close(targets * batch.mask, by_hand, atol=1e-6, rtol=0)
    assert {rollout for rollout, _ in seen["value_targets"]} == {1, 2, 3}
    logs = read_scalars(only_run_dir(tmp_path))
    assert [step for step, _ in logs["val/warmup_value_loss"]] == [1, 2] and "val/warmup_explained_variance" in logs
