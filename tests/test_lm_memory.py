"""Memory levers of the LM scripts change nothing numerically, and do what their flags say: chosen-token log-probs
without a full log-softmax, gradient checkpointing, gradient accumulation, evaluation and sampling in batches."""
import pytest
import torch
from conftest import CPU_FLOAT32, read_scalars, run_in_process
from lm_models import make_model, save_checkpoint
from test_real_models import state, write_data

from scale import grpo, rlhf_ppo


@pytest.mark.parametrize("script", [grpo, rlhf_ppo])
def test_token_logprobs_equal_the_full_log_softmax(script):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5))
    full = torch.log_softmax(logits, -1)
    expected = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logprobs, entropy = script.token_logprobs(logits, tokens, with_entropy=True)
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1), atol=1e-5, rtol=0)
    grad, = torch.autograd.grad(logprobs.sum(), logits)
    expected_grad, = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradient_checkpointing_changes_nothing(arch):
    torch.manual_seed(0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" else {}
    model = make_model(arch, 64, **no_dropout)
    ids = torch.randint(0, 64, (2, 12))
    results = []
    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        model.train().zero_grad()
        logits = model(input_ids=ids).logits
        loss = -grpo.token_logprobs(logits[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-7)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("script,data", [("scale/sft.py", "prompt_completion"), ("scale/reward_model.py", "explicit"),
                                         ("scale/dpo.py", "explicit")])
def test_gradient_accumulation_gives_the_same_update(tmp_path, script, data, monkeypatch):
    """A batch of 8 in one step, in 2 micro-batches of 4, and in 4 of 2 with --gradient-checkpointing: the same loss
    and gradient norm (AdamW is blind to a gradient's scale, so the logged norm is what shows a wrong
    normalization), and the same weights within 1% of the distance they moved (10 steps at lr 1e-3: Adam turns
    rounding noise in near-zero gradients into steps of up to lr; measured differences up to 1.4e-5 after 3 steps).
    Counted at each decoder layer's MLP, the flags do what they say: the passes with gradients are on 1/2 and 1/4 of the
    batch, twice and four times as many, and the checkpointed run computes each layer once more in the backward
    pass; --eval-batch-size 3, whatever the micro-batch, is the reward model's eval pairs per pass (6 sequences)
    and DPO's prompts per sampling call (SFT samples only on the built-in task)."""
    import importlib

    from transformers.models.llama.modeling_llama import LlamaMLP  # the layer's forward is the checkpoint's wrapper

    base = save_checkpoint(str(tmp_path / "base"), "llama", "eos_no_pad", "float32")
    data = write_data(tmp_path / "d.jsonl", data)
    weights, logs, passes, sampled = [], [], {}, {}
    module = importlib.import_module(script[: -len(".py")].replace("/", "."))
    real_sample = getattr(module, "generate", None)  # the reward model samples nothing
    loss_tag = "losses/loss"
    original = LlamaMLP.forward
    for accumulation in (1, 2, 4):
        out = f"out{accumulation}"
        extra = ["--reward-model-path", "None"] if script == "scale/dpo.py" else []
        extra += ["--gradient-checkpointing"] if accumulation == 4 else []
        calls = passes[accumulation] = []  # (gradients on, rows) of every layer's MLP pass, recomputations included

        def forward(self, x, _calls=calls):
            _calls.append((torch.is_grad_enabled(), x.shape[0]))
            return original(self, x)

        monkeypatch.setattr(LlamaMLP, "forward", forward)
        prompts = sampled[accumulation] = []  # how many prompts each call of the sampler completes
        if real_sample is not None:
            monkeypatch.setattr(module, "generate", lambda model, ids, *a, _prompts=prompts, **k:
                                (_prompts.append(len(ids)), real_sample(model, ids, *a, **k))[1])
        run_in_process(script, *CPU_FLOAT32, "--model-name-or-path", base, "--dataset-name", data, "--max-steps", "10", "--batch-size", "8",
                       "--gradient-accumulation-steps", str(accumulation), "--lr", "1e-3", "--warmup-steps", "1",
                       "--eval-every", "10", "--eval-batch-size", "3", "--output-dir", out, "--exp-name", out, *extra,
                       cwd=tmp_path)
        weights.append(state(tmp_path / out, "AutoModelForSequenceClassification" if script == "scale/reward_model.py"
                             else "AutoModelForCausalLM")[1])
        logs.append(read_scalars(str(next((tmp_path / "runs").glob(f"{out}__*")))))
    for other, other_logs in zip(weights[1:], logs[1:]):
        for tag in (loss_tag, "train/grad_norm"):
            assert other_logs[tag][-1][1] == pytest.approx(logs[0][tag][-1][1], rel=1e-4), tag
        for key in weights[0]:
            torch.testing.assert_close(other[key], weights[0][key], atol=1e-4, rtol=0, msg=key)  # 1% of 10 × 1e-3
    trained = {a: [rows for grad, rows in calls if grad] for a, calls in passes.items()}
    (whole,) = set(trained[1])  # 8 examples, or 8 pairs: 16 sequences
    assert set(trained[2]) == {whole // 2} and len(trained[2]) == 2 * len(trained[1])
    assert set(trained[4]) == {whole // 4} and len(trained[4]) == 2 * 4 * len(trained[1])  # each layer recomputed
    if script == "scale/reward_model.py":
        assert all(max(rows for grad, rows in calls if not grad) == 6 for calls in passes.values())
    if script == "scale/dpo.py":
        assert all(max(prompts) == 3 for prompts in sampled.values())


def test_rlhf_ppo_micro_batches_keep_the_first_ratio_exact_and_the_update(tiny_checkpoints, tmp_path):
    """A minibatch of 8 in 2 micro-batches: the first ratio is still exactly 1 and the update is the same."""
    models = tiny_checkpoints["cwd"] / "models"
    outs = []
    for accumulation in (1, 2):
        run_in_process("scale/rlhf_ppo.py", *CPU_FLOAT32, "--model-name-or-path", str(models / "sft"), "--reward-model-path",
                       str(models / "reward_model"), "--num-iterations", "2", "--batch-size", "16", "--mini-batch-size", "8",
                       "--gradient-accumulation-steps", str(accumulation), "--eval-size", "8", "--generation-batch-size", "6",
                       "--output-dir", f"ppo{accumulation}", "--exp-name", f"ppo{accumulation}", cwd=tmp_path)
        scalars = read_scalars(str(next((tmp_path / "runs").glob(f"ppo{accumulation}__*"))))
        assert [v for _, v in scalars["policy/first_ratio_max_error"]] == [0.0, 0.0]
        outs.append((state(tmp_path / f"ppo{accumulation}")[1], scalars))
    (one, logs_one), (two, logs_two) = outs
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-4, rtol=0, msg=key)
    for tag in ("losses/policy_loss", "losses/value_loss", "policy/approx_kl", "policy/clipfrac"):
        assert logs_two[tag][0][1] == pytest.approx(logs_one[tag][0][1], abs=1e-5), tag


@pytest.mark.parametrize("script", ["scale/rlhf_ppo.py", "scale/grpo.py"])
def test_rollout_forward_passes_use_the_update_micro_batch_size(tiny_checkpoints, tmp_path, script, monkeypatch):
    """The first ratio is exactly 1 because the rollout's log-probs come from forward passes of the same size as
    the update's. On this CPU a batch of 4 and one of 8 happen to give the same bits, so the sizes are checked.
    With --gradient-checkpointing, every pass with gradients (the policy's, and rlhf_ppo's critic's) computes its
    layer's MLP twice: once more in the backward pass. The rollout's 16 completions are sampled at most
    --generation-batch-size 6 at a time."""
    import importlib

    module = importlib.import_module(script[: -len(".py")].replace("/", "."))
    real_sample, sampled = module.generate, []  # how many prompts each call of the sampler completes
    monkeypatch.setattr(module, "generate",
                        lambda model, ids, *a, **k: (sampled.append(len(ids)), real_sample(model, ids, *a, **k))[1])
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Model

    sizes = []  # (grad enabled, batch size) of every full-sequence forward pass of the policy
    trained = {"bodies": 0, "mlps": 0}  # passes with gradients of any model's transformer, and of its MLPs

    def record(module, args, kwargs):
        # prompts are 10-14 tokens, responses 14: a pass wider than 18 is over prompt + response, and one of 13
        # tokens after a cache (grpo's G rows of a prompt share its pass) is over the responses; generation's
        # passes are over the prompts alone (no cache yet) or one token wide
        width, cached = kwargs["input_ids"].shape[1], kwargs.get(rlhf_ppo.CACHE) is not None
        if isinstance(module, GPT2LMHeadModel) and (width > 18 or (cached and width > 1)):
            sizes.append((torch.is_grad_enabled(), kwargs["input_ids"].shape[0]))

    models = tiny_checkpoints["cwd"] / "models"
    original = GPT2LMHeadModel.forward  # wrapped for the run: every instance (actor, reference) records its calls

    def forward(self, *args, **kwargs):
        record(self, args, kwargs)
        return original(self, *args, **kwargs)

    body, mlp = GPT2Model.forward, GPT2MLP.forward

    def count(original, key):
        def counted(*args, **kwargs):
            trained[key] += torch.is_grad_enabled()
            return original(*args, **kwargs)
        return counted

    GPT2LMHeadModel.forward, GPT2Model.forward, GPT2MLP.forward = forward, count(body, "bodies"), count(mlp, "mlps")
    try:
        flags = (["--reward-model-path", str(models / "reward_model"), "--num-iterations", "1"] if script == "scale/rlhf_ppo.py"
                 else ["--num-iterations", "1", "--num-generations", "4"])
        run_in_process(script, *CPU_FLOAT32, "--model-name-or-path", str(models / "sft"), *flags, "--batch-size", "16", "--mini-batch-size",
                       "8", "--gradient-accumulation-steps", "2", "--eval-size", "6", "--generation-batch-size", "6",
                       "--response-length", "14", "--gradient-checkpointing", "--output-dir", "out", cwd=tmp_path)
    finally:
        GPT2LMHeadModel.forward, GPT2Model.forward, GPT2MLP.forward = original, body, mlp
    update = {size for grad, size in sizes if grad}
    no_grad = {size for grad, size in sizes if not grad}
    assert update == {4}  # minibatch 8 in 2 micro-batches
    assert no_grad == {4, 2}  # the rollout's and the evaluation's passes in micro-batches of 4 (6 = 4 + 2)
    assert trained["bodies"] > 0 and trained["mlps"] == 2 * trained["bodies"]  # one layer (TINY_LM), recomputed
    assert sorted(sampled) == [4, 6, 6, 6, 6]  # the rollout's 16 in 6 + 6 + 4; two evaluations of 6 prompts
