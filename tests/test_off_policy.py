"""Off-policy RL, scale/grpo.py's and scale/rlhf_ppo.py's alone: the sampler's log-probs, the rollout/ tags,
--rollout-lag, the importance-sampling corrections (TRL 1.16's vllm_importance_sampling_* and
off_policy_mask_threshold); and in both tiers the places where the scripts compute what TRL 1.16 does (unscored
completions, dapo's normalizer) and the sampler's log-probs that generate returns."""
import math

import pytest
import torch
from conftest import CPU_FLOAT32, one_line_exit, only_run_dir, read_scalars, run_in_process

import grpo
import rlhf_ppo
from scale import grpo as scale_grpo
from scale import rlhf_ppo as scale_rlhf_ppo

IDS = ["grpo", "scale.grpo", "rlhf_ppo", "scale.rlhf_ppo"]
SCALE = [scale_grpo, scale_rlhf_ppo]  # the off-policy machinery is scale/'s alone


# ------------------------------------------------------------------------------------------------
# The math, by hand
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", SCALE, ids=IDS[1::2])
def test_sampler_importance_weights_by_hand(module):
    """Row 0: π_old = 0.5, 0.2 where the sampler had 0.25, 0.4 (ρ_t = 2, 0.5), then a padding token; row 1:
    π_old 0.5, 0.5 against 0.1, 0.25 (ρ_t = 5, 2). Token modes: clip(ρ_t, 0.6, 1.5) = 1.5, 0.6 | 1.5, 1.5, and the
    mask 1[0.6 ≤ ρ_t ≤ 1.5] keeps none of these; with C_max 3 alone ρ_t = 2, 0.5 | 0, 2. Sequence modes: ρ_0 = 2 · 0.5
    = 1, ρ_1 = 5 · 2 = 10 (a product, not a mean): clip to [0.6, 3] = 1 | 3, the mask keeps row 0 only. Padding: 1."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.7], [0.5, 0.5, 0.7]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.1, 0.25, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    weights = lambda mode, low, high: module.sampler_importance_weights(old, sampler, mask, mode, low, high)  # noqa: E731
    torch.testing.assert_close(weights("token_truncate", 0.6, 1.5), torch.tensor([[1.5, 0.6, 1.0], [1.5, 1.5, 1.0]]))
    torch.testing.assert_close(weights("token_mask", 0.6, 1.5), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    torch.testing.assert_close(weights("token_mask", None, 3.0), torch.tensor([[2.0, 0.5, 1.0], [0.0, 2.0, 1.0]]))
    torch.testing.assert_close(weights("token_truncate", None, None), torch.tensor([[2.0, 0.5, 1.0], [5.0, 2.0, 1.0]]))
    torch.testing.assert_close(weights("sequence_truncate", 0.6, 3.0), torch.tensor([[1.0] * 3, [3.0] * 3]))
    torch.testing.assert_close(weights("sequence_mask", 0.6, 3.0), torch.tensor([[1.0] * 3, [0.0] * 3]))
    torch.testing.assert_close(weights("sequence_mask", None, None), torch.tensor([[1.0] * 3, [10.0] * 3]))


@pytest.mark.parametrize("module", [scale_grpo], ids=IDS[1:2])
def test_off_policy_sequence_mask_by_hand(module):
    """DeepSeek-V3.2's eq. 9 with δ = 0.5: row 0, Â < 0 and mean log(π_sampler/π_θ) = (0.8 + 0.4) / 2 = 0.6 > δ:
    dropped; row 1, Â < 0 and 0.2 ≤ δ: kept; row 2, 1.0 > δ but Â > 0: kept. The padding token of row 1 (its
    log-ratio 5) counts in neither sum nor length."""
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, 4.0], [-1.0, -1.0]])
    logprobs = torch.tensor([[-1.8, -1.4], [-1.2, -1.0], [-2.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    kept = module.off_policy_sequence_mask(torch.tensor([-1.0, -2.0, 1.0]), logprobs, sampler, mask, 0.5)
    assert kept.tolist() == [[0.0], [1.0], [1.0]] and not kept.requires_grad


@pytest.mark.parametrize("module", SCALE, ids=IDS[1::2])
def test_the_corrections_at_their_bounds(module):
    """A weight exactly at C_max or C_min is kept by the mask modes (C_min ≤ ρ ≤ C_max), one a hair outside is not;
    the truncate modes clip to the bound itself. The off-policy sequence mask keeps Â = 0 (only Â < 0 is dropped)
    and a divergence exactly δ (only > δ is), computed from log-probs whose mean difference is exactly 0.5."""
    old, sampler = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.4]]))
    mask = torch.ones(1, 2)
    rho = torch.exp((old - sampler) * mask)  # the function's own ρ_t: ≈ 2 and 0.5
    high, low = float(rho[0, 0]), float(rho[0, 1])
    assert module.sampler_importance_weights(old, sampler, mask, "token_mask", low, high).tolist() == rho.tolist()
    assert module.sampler_importance_weights(old, sampler, mask, "token_mask", low, high * 0.999).tolist() == [
        [0.0, rho[0, 1].item()]]
    assert module.sampler_importance_weights(old, sampler, mask, "token_mask", low * 1.001, high).tolist() == [
        [rho[0, 0].item(), 0.0]]
    torch.testing.assert_close(module.sampler_importance_weights(old, sampler, mask, "token_truncate", 0.6, 1.5),
                               torch.tensor([[1.5, 0.6]]))
    if hasattr(module, "off_policy_sequence_mask"):
        logprobs, sampler = torch.tensor([[-1.5, -2.5], [-1.5, -2.5]]), torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
        kept = module.off_policy_sequence_mask(torch.tensor([0.0, -1.0]), logprobs, sampler, torch.ones(2, 2), 0.5)
        assert kept.tolist() == [[1.0], [1.0]]  # Â = 0 kept; the divergence 0.5 = δ kept
        kept = module.off_policy_sequence_mask(torch.tensor([0.0, -1.0]), logprobs, sampler, torch.ones(2, 2), 0.49)
        assert kept.tolist() == [[1.0], [0.0]]


@pytest.mark.parametrize("module", SCALE, ids=IDS[1::2])
def test_sampler_mismatch_by_hand(module):
    """log r = log π_old − log π_sampler = log 2, log 0.25 and a padding token: Σ|log r| = 0.693147 + 1.386294, the
    max 1.386294, Σ k3 = (2 − 1 − 0.693147) + (0.25 − 1 + 1.386294) = 0.943147, and one token (0.25) outside
    [1/3, 3]; all 0 where the sampler is π_old."""
    old = torch.log(torch.tensor([[0.5, 0.1, 0.3]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    total, largest, k3, outside = module.sampler_mismatch(old, sampler, mask, 3.0)
    assert total.item() == pytest.approx(2.079442, abs=1e-5) and largest.item() == pytest.approx(1.386294, abs=1e-5)
    assert k3.item() == pytest.approx(0.943147, abs=1e-5) and outside.item() == 1
    assert [x.item() for x in module.sampler_mismatch(old, old, mask, 3.0)] == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("module", [grpo, scale_grpo], ids=IDS[:2])
def test_unscored_completions_leave_the_baseline_with_advantage_0(module):
    """G = 4: rewards 1, 0, None, 0.5 | None × 4. As TRL 1.16: the scored three's mean 0.5 and std (G − 1 → 2) 0.5,
    so grpo's Â = ±0.5 / (0.5 + 1e-4), 0 and 0 for the unscored one; rloo: 1 − 0.25, 0 − 0.75, 0, 0.5 − 0.5;
    reinforce_pp over the scored: mean 0.5, population variance 1/6: ±1.224745; the all-unscored group: 0. Counted
    as reward 0 (the old way), group 1's mean would be 0.375."""
    nan = math.nan
    rewards = torch.tensor([1.0, 0.0, nan, 0.5, nan, nan, nan, nan])
    a = 0.5 / (0.5 + 1e-4)
    cases = {"grpo": [a, -a, 0.0, 0.0], "rloo": [0.75, -0.75, 0.0, 0.0],
             "reinforce_pp": [1.224745, -1.224745, 0.0, 0.0], "reinforce_pp_baseline": [1.224745, -1.224745, 0.0, 0.0]}
    for advantage, expected in cases.items():
        torch.testing.assert_close(module.compute_advantages(rewards, 4, advantage, True),
                                   torch.tensor(expected + [0.0] * 4), msg=advantage)
    assert module.informative_groups(torch.tensor([1.0, nan, 1.0, 1.0, 0.0, nan, nan, 1.0]), 4).tolist() == [False, True]


def test_generate_returns_the_log_prob_of_each_token_it_drew():
    """The sampler's log-probs are those the update computes for the same tokens (one pass over prompt + response)
    to float32 rounding (the KV-cache steps sum in another order), at temperature 0.7, and 0 on padding."""
    from lm_models import make_model

    torch.manual_seed(0)
    model = make_model("llama", 400).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [10, 11]]
    for module in (grpo, scale_grpo):
        with torch.no_grad():
            sequences, attention_mask, width, mask, sampled = module.generate(model, prompts, 0, [3], 10, 0.7)
            trained, _ = module.policy_logprobs(model, sequences, attention_mask, width, 0.7)
        assert torch.allclose(sampled, trained * mask, atol=1e-4, rtol=0), (sampled - trained * mask).abs().max()
        assert (sampled[mask == 0] == 0).all() and (sampled[mask == 1] < 0).all()


# ------------------------------------------------------------------------------------------------
# End to end: what the sampler used, what the tags say, what the flags do to the loss
# ------------------------------------------------------------------------------------------------
def rl_flags(script, checkpoints):
    models = ["--model-name-or-path", str(checkpoints["sft"])]
    if script.endswith("rlhf_ppo.py"):
        return [*models, "--reward-model-path", str(checkpoints["reward_model"]), "--batch-size", "16",
                "--mini-batch-size", "8", "--ppo-epochs", "2", "--eval-size", "0"]
    return [*models, "--batch-size", "16", "--num-generations", "4", "--mini-batch-size", "8", "--ppo-epochs", "2",
            "--eval-size", "0"]


@pytest.mark.parametrize("script", ["scale/grpo.py", "scale/rlhf_ppo.py"])
def test_the_rollout_lag_samples_with_the_weights_of_k_iterations_before(tiny_checkpoints, tmp_path, monkeypatch,
                                                                         script):
    """--rollout-lag 2 over 5 iterations: the training rollouts sample with θ_0, θ_0, θ_0, θ_1, θ_2 (θ_i: the weights
    after i updates), read from the model at each sampling call; the update then gets the current weights back. The
    rollout/ tags: at the first iteration (the sampler is the policy) the KV-cache sampler's float32 rounding only
    (|Δ log π| < 1e-4, KL < 1e-8), later the lag's, far larger."""
    import importlib

    module = importlib.import_module(script[:-3].replace("/", "."))
    name = "generate_in_chunks" if hasattr(module, "generate_in_chunks") else "generate"
    real, real_swap, sampled_with, swapped = getattr(module, name), module.swap_weights, [], []

    def recording(model, prompt_ids, *args, **kwargs):
        if len(prompt_ids) == 16:  # the training rollout (--eval-size 0: no evaluation samples)
            sampled_with.append(sum(p.double().sum().item() for p in model.parameters() if p.requires_grad))
        return real(model, prompt_ids, *args, **kwargs)

    def swap(parameters, weights):  # twice per iteration: the sampler's weights in, then the current ones back
        swapped.append(sum(p.double().sum().item() for p in parameters))
        return real_swap(parameters, weights)

    monkeypatch.setattr(module, name, recording)
    monkeypatch.setattr(module, "swap_weights", swap)
    run_in_process(script, *CPU_FLOAT32, *rl_flags(script, tiny_checkpoints), "--num-iterations", "5",
                   "--rollout-lag", "2", "--output-dir", "out", cwd=tmp_path)
    policy_at_start = swapped[::2]  # θ_i at the start of iteration i + 1, before the sampler's weights come in
    assert len(sampled_with) == 5 and len(policy_at_start) == 5
    theta = policy_at_start
    assert sampled_with == pytest.approx([theta[0], theta[0], theta[0], theta[1], theta[2]], rel=0, abs=1e-9)
    assert len(set(round(t, 6) for t in theta)) == 5  # every update moved the weights
    logs = read_scalars(only_run_dir(tmp_path))
    diff_max, kl = dict(logs["rollout/logprob_diff_max"]), dict(logs["rollout/kl_k3"])
    assert diff_max[1] < 1e-4 and kl[1] < 1e-8, (diff_max, kl)
    assert all(diff_max[i] > 1e-3 and kl[i] > 1e-7 for i in (2, 3, 4, 5)), (diff_max, kl)
    assert "rollout/is_weight_mean" in logs  # on by default with a lag


@pytest.mark.parametrize("script,mode", [("scale/grpo.py", "token_truncate"), ("scale/grpo.py", "token_mask"),
                                         ("scale/rlhf_ppo.py", "sequence_truncate"), ("scale/rlhf_ppo.py", "sequence_mask")])
def test_the_correction_flags_reach_the_loss(small_checkpoints, tmp_path, monkeypatch, capsys, script, mode):
    """Each mode and both bounds reach sampler_importance_weights with the rollout's log-probs, and what it returns
    multiplies every token's policy loss: replaced by zeros, the policy loss is 0 at every step (the value loss of
    rlhf_ppo is not weighted). Without --vllm-importance-sampling-correction it is never called. Each run says at
    its start the lag and the correction, or that there is none."""
    import importlib

    module = importlib.import_module(script[:-3].replace("/", "."))
    seen, real = [], module.sampler_importance_weights

    def zeros(old_logprobs, sampler_logprobs, mask, mode, clip_min, clip_max):
        seen.append((mode, clip_min, clip_max, old_logprobs.shape == sampler_logprobs.shape == mask.shape))
        return torch.zeros_like(real(old_logprobs, sampler_logprobs, mask, mode, clip_min, clip_max))

    monkeypatch.setattr(module, "sampler_importance_weights", zeros)
    flags = [*CPU_FLOAT32, *rl_flags(script, small_checkpoints), "--num-iterations", "2"]
    (tmp_path / "zeros").mkdir(), (tmp_path / "off").mkdir()
    run_in_process(script, *flags, "--vllm-importance-sampling-correction", "--vllm-importance-sampling-mode", mode,
                   "--vllm-importance-sampling-clip-min", "0.25", "--vllm-importance-sampling-clip-max", "2.5",
                   "--output-dir", "out", cwd=tmp_path / "zeros")
    assert seen == [(mode, 0.25, 2.5, True)] * 2
    note = f"note: --rollout-lag 0, corrected by --vllm-importance-sampling-mode {mode} (bounds (0.25, 2.5))\n"
    assert note in capsys.readouterr().out
    logs = read_scalars(only_run_dir(tmp_path / "zeros"))
    assert [v for _, v in logs["losses/policy_loss"]] == [0.0, 0.0]
    seen.clear()
    run_in_process(script, *flags, "--rollout-lag", "1", "--no-vllm-importance-sampling-correction",
                   "--output-dir", "out", cwd=tmp_path / "off")
    assert seen == [] and all(v != 0 for _, v in read_scalars(only_run_dir(tmp_path / "off"))["losses/policy_loss"])
    assert "note: --rollout-lag 1, no correction (--vllm-importance-sampling-correction)\n" in capsys.readouterr().out
    run_in_process(script, *flags, "--output-dir", "out", cwd=tmp_path / "off")  # no lag, no correction: no note
    assert "note: --rollout-lag" not in capsys.readouterr().out


@pytest.mark.parametrize("script", ["scale/grpo.py"])
def test_the_off_policy_mask_reaches_the_loss(small_checkpoints, tmp_path, monkeypatch, script):
    """--off-policy-mask-threshold δ reaches off_policy_sequence_mask with the update's log-probs, and the mask
    multiplies the policy loss: a mask of zeros leaves a policy loss of 0; the share it drops is logged."""
    import importlib

    module = importlib.import_module(script[:-3].replace("/", "."))
    seen = []

    def drop_all(advantages, logprobs, sampler_logprobs, mask, delta):
        seen.append(delta)
        return torch.zeros(len(mask), 1)

    monkeypatch.setattr(module, "off_policy_sequence_mask", drop_all)
    flags = [*CPU_FLOAT32, *rl_flags(script, small_checkpoints), "--num-iterations", "1", "--output-dir", "out"]
    run_in_process(script, *flags, "--off-policy-mask-threshold", "0.3", cwd=tmp_path)
    assert seen == [0.3] * 4  # 2 epochs × 2 minibatches
    logs = read_scalars(only_run_dir(tmp_path))
    assert logs["losses/policy_loss"] == [(1, 0.0)] and logs["policy/off_policy_masked_fraction"] == [(1, 1.0)]
    monkeypatch.undo()  # without the mask the same run has a loss to drop
    (tmp_path / "unmasked").mkdir()
    run_in_process(script, *flags, cwd=tmp_path / "unmasked")
    assert read_scalars(only_run_dir(tmp_path / "unmasked"))["losses/policy_loss"][0][1] != 0


@pytest.mark.parametrize("script", ["grpo.py", "scale/grpo.py"])
def test_dapo_divides_by_the_rollouts_tokens_per_step(small_checkpoints, tmp_path, monkeypatch, script):
    """--loss-type dapo (and cispo) over 2 minibatches per pass: each step's normalizer is the rollout's tokens ÷ 2,
    as TRL 1.16's (so that every token of the rollout weighs the same), not the minibatch's own count."""
    import importlib

    module = importlib.import_module(script[:-3].replace("/", "."))
    seen, real = [], module.aggregate_loss

    def spy(per_token_loss, mask, loss_type, num_sequences, num_tokens, max_completion_length):
        seen.append((mask.sum().item(), num_tokens))
        return real(per_token_loss, mask, loss_type, num_sequences, num_tokens, max_completion_length)

    rollout = []
    name = "generate_in_chunks" if hasattr(module, "generate_in_chunks") else "generate"
    real_generate = getattr(module, name)

    def recording(model, prompt_ids, *args, **kwargs):
        out = real_generate(model, prompt_ids, *args, **kwargs)
        if len(prompt_ids) == 16:
            rollout.append(out[3].sum().item())
        return out

    monkeypatch.setattr(module, "aggregate_loss", spy)
    monkeypatch.setattr(module, name, recording)
    run_in_process(script, *CPU_FLOAT32, *rl_flags(script, small_checkpoints), "--num-iterations", "1", "--beta", "0",
                   "--loss-type", "dapo", "--ppo-epochs", "1", "--output-dir", "out", cwd=tmp_path)
    (tokens,) = rollout
    assert [n for _, n in seen] == [tokens / 2, tokens / 2]
    assert "rollout/is_weight_mean" not in read_scalars(only_run_dir(tmp_path))  # at lag 0, no correction by default
    assert any(own != tokens / 2 for own, _ in seen), seen  # the minibatches' own counts differ: the test can tell


@pytest.mark.parametrize("script", ["rlhf_ppo.py", "scale/rlhf_ppo.py"])
def test_a_response_no_reward_function_scores_has_no_loss(small_checkpoints, tmp_path, monkeypatch, script):
    """rlhf_ppo.py with a reward function that returns None for every response: a response with a stop token is
    unscored and none of its tokens has a policy or value loss (the loss's mask is 0 there; the old way scored it 0
    and trained on it); one cut at the length limit keeps --missing-eos-penalty, a score, and its loss."""
    import importlib

    from transformers import AutoTokenizer

    module = importlib.import_module(script[:-3].replace("/", "."))
    (tmp_path / "rewards.py").write_text("def none(prompts, completions, **columns):\n"
                                         "    return [None] * len(completions)\n")
    name = "generate_in_chunks" if hasattr(module, "generate_in_chunks") else "generate"
    real_generate, real_loss, rollouts, masks = getattr(module, name), module.policy_loss, [], []

    def recording(model, prompt_ids, *args, **kwargs):
        rollouts.append(real_generate(model, prompt_ids, *args, **kwargs))
        return rollouts[-1]

    def spy(logprobs, old_logprobs, advantages, mask, *args):
        masks.append(mask.clone())
        return real_loss(logprobs, old_logprobs, advantages, mask, *args)

    monkeypatch.setattr(module, name, recording)
    monkeypatch.setattr(module, "policy_loss", spy)
    run_in_process(script, *CPU_FLOAT32, "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-fn",
                   f"{tmp_path / 'rewards.py'}:none", "--reward-model-path", "None", "--batch-size", "16", "--mini-batch-size", "8", "--ppo-epochs",
                   "1", "--num-iterations", "1", "--eval-size", "0", "--response-length", "7", "--output-dir", "out",
                   cwd=tmp_path)
    (sequences, _, width, mask, _), = rollouts
    stops = torch.tensor(module.stop_token_ids(AutoTokenizer.from_pretrained(small_checkpoints["sft"])))
    stopped = (torch.isin(sequences[:, width:], stops) & mask.bool()).any(1)
    assert 0 < stopped.sum() < len(stopped), stopped  # some unscored, some cut at the limit and scored
    torch.testing.assert_close(torch.cat(masks), mask.float() * ~stopped.unsqueeze(1))


@pytest.mark.parametrize("module", [rlhf_ppo, scale_rlhf_ppo], ids=IDS[2:])
def test_whitening_with_no_valid_token_is_zero(module):
    """Every response unscored: no valid token to whiten over; all 0 (not 0/0), so the losses are 0, not NaN."""
    assert module.masked_whiten(torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("script", ["scale/grpo.py", "scale/rlhf_ppo.py"])
@pytest.mark.parametrize("flags,words", [
    (["--rollout-lag", "-1"], ["--rollout-lag -1", "0 or more"]),
    (["--vllm-importance-sampling-mode", "truncate"], ["'truncate'", "token_truncate, token_mask"]),
    (["--vllm-importance-sampling-clip-max", "nan"], ["clip-max nan", "finite"]),
    (["--vllm-importance-sampling-clip-min", "3", "--vllm-importance-sampling-clip-max", "2"], ["clip-min 3", "below"]),
])
def test_bad_off_policy_flags_are_one_line(tmp_path, script, flags, words):
    message = one_line_exit(script, *CPU_FLOAT32, *flags, cwd=tmp_path)
    assert all(word in message for word in words), message


@pytest.mark.parametrize("script", ["grpo.py", "scale/grpo.py"])
def test_cispo_without_its_cap_is_one_line(tmp_path, script):
    """CISPO's cap is --epsilon-high itself (TRL's meaning): left at None it would cap the weight at ε = 0.2."""
    message = one_line_exit(script, *CPU_FLOAT32, "--loss-type", "cispo", cwd=tmp_path)
    assert "--epsilon-high" in message and "5.0" in message, message
    if script.startswith("scale/"):
        message = one_line_exit(script, *CPU_FLOAT32, "--off-policy-mask-threshold", "-1", cwd=tmp_path)
        assert "--off-policy-mask-threshold -1" in message, message


@pytest.mark.parametrize("flags,words", [(["--loss-type", "dppo"], ["'dppo'", "scale/grpo.py's"]),
                                         (["--advantage", "maxrl"], ["'maxrl'", "scale/grpo.py's"]),
                                         (["--scale-rewards", "batch"], ["'batch'", "scale/grpo.py's"])])
def test_a_variant_of_scale_alone_is_one_line_in_the_reference(tmp_path, flags, words):
    """grpo.py has none of the later variants: a value of the reference's own flags (--loss-type, --advantage,
    --scale-rewards) that only scale/grpo.py takes stops in one line that says where it is."""
    message = one_line_exit("grpo.py", *CPU_FLOAT32, *flags, cwd=tmp_path)
    assert all(word in message for word in words), message


@pytest.mark.parametrize("script", ["scale/grpo.py", "scale/rlhf_ppo.py"])
def test_a_lagged_run_does_not_resume(tmp_path, script):
    """A checkpoint holds the current weights, not the K older ones the sampler needs: --resume with --rollout-lag
    is one line, not a resume that is not exact."""
    message = one_line_exit(script, *CPU_FLOAT32, "--rollout-lag", "2", "--resume", "runs/x", cwd=tmp_path)
    assert "--resume with --rollout-lag" in message, message
