"""The GPU path, checked on the CPU: one precision path for the policy and its reference (under --bf16 the KL
and DPO's margin are exactly 0 before the first update), the temperature and log-probs in float32, no float32
copy of the logits kept, one gradient all-reduce per optimizer step, the saved dtype, and the smaller points."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_one_line_error, read_scalars, run_in_process, run_script
from lm_models import save_checkpoint
from test_real_models import state, write_data

from scale import grpo, rlhf_ppo, sft


def scalars_of(cwd, name):
    return read_scalars(str(next((cwd / "runs").glob(f"{name}__*"))))


# ------------------------------------------------------------------------------------------------
# One precision path: under --bf16 the reference computes exactly what the policy computes
# ------------------------------------------------------------------------------------------------
def test_bf16_kl_is_exactly_zero_before_the_first_update(tiny_checkpoints, tmp_path):
    """The reference was held in bf16 while the policy ran fp32 weights under autocast: per-token |Δ log p| up to
    0.2 before any update. Now held and computed as the policy: rlhf_ppo's and grpo's KL (k1 and k3) of the first
    rollout and eval/kl before training are exactly 0, and the first ratio exactly 1."""
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("scale/rlhf_ppo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path",
                   str(models / "reward_model"), "--num-iterations", "1", "--batch-size", "16", "--mini-batch-size", "8",
                   "--eval-size", "16", "--bf16", "--temperature", "0.7", "--output-dir", "ppo", cwd=tmp_path)
    run_in_process("scale/grpo.py", "--model-name-or-path", str(models / "sft"), "--num-iterations", "1", "--batch-size", "16",
                   "--num-generations", "4", "--mini-batch-size", "8", "--eval-size", "16", "--bf16", "--temperature",
                   "0.7", "--output-dir", "grpo", cwd=tmp_path)
    for name in ("rlhf_ppo", "grpo"):
        logs = scalars_of(tmp_path, name)
        assert logs["objective/kl"][0] == (1, 0.0), name
        assert logs["objective/kl_k3"][0] == (1, 0.0), name
        assert logs["eval/kl"][0] == (0, 0.0), name
        assert logs["policy/first_ratio_max_error"][0] == (1, 0.0), name


def test_bf16_dpo_margin_is_exactly_zero_before_the_first_update(tiny_checkpoints, tmp_path):
    """DPO's implicit reward margin β(log π/π_ref(y_w) − log π/π_ref(y_l)) on the first batch (logged at step 1,
    computed before its update) and eval/kl before training: 0 under --bf16 (−1.3e-4 with a bf16 reference).
    A reference computed ahead, in batches of other pairs and so of other padded shapes, differed from the
    policy by rounding (margin −3.0e-8 on this batch of 64 of 400 pairs); computed on the micro-batch the
    policy sees, it cannot."""
    models = tiny_checkpoints["cwd"] / "models"
    run_in_process("scale/dpo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path", "None",
                   "--max-steps", "1", "--num-train-pairs", "400", "--eval-size", "16", "--bf16", "--output-dir", "dpo",
                   cwd=tmp_path)
    logs = scalars_of(tmp_path, "dpo")
    assert logs["train/margin"][0] == (1, 0.0)
    assert logs["train/reward_chosen"][0] == (1, 0.0)
    assert logs["losses/loss"][0][1] == pytest.approx(math.log(2), abs=1e-7)
    assert logs["eval/kl"][0] == (0, 0.0)


@pytest.mark.parametrize("script", [rlhf_ppo, grpo])
def test_the_temperature_divides_float32_logits(script):
    """generate divides float32 logits by T; training divided bf16 logits (0.028 per token apart at T = 0.7).
    The log-probs of bf16 logits are those of their float32 values divided by T in float32."""
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 6, 50)).bfloat16()
    tokens = torch.randint(0, 50, (3, 6))
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    in_bf16 = torch.log_softmax((logits / 0.7).float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (in_bf16 - expected).abs().max() > 1e-3  # the old way is measurably off
    torch.testing.assert_close(script.token_logprobs(logits, tokens, temperature=0.7), expected, atol=2e-6, rtol=0)


def saved_bytes(fn, *args):
    """Bytes of every tensor autograd saves for the backward pass of fn(*args) (each storage counted once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(storages.values()), out


def test_no_float32_copy_of_the_logits_is_kept_for_backward():
    """token_logprobs (grpo's and rlhf_ppo's, for the first response token of a shared prompt) kept each row's
    float32 copy for backward (31.3 MiB saved for bf16 logits of 15.6 MiB at [4, 64, 32000]). Now only the logits
    themselves (and the small per-token tensors), and the gradients are those of the full log-softmax. The LM
    head's own output is not made whole at all elsewhere (head_logprobs: tests/test_scaling.py). The bytes kept
    scale with the logits, so a smaller vocabulary shows the same ratio in a quarter of the time."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 64, 8000)).bfloat16().requires_grad_()
    tokens = torch.randint(0, 8000, (4, 64))
    fn = lambda: grpo.token_logprobs(logits, tokens, temperature=0.7).sum()  # noqa: E731
    reference = lambda: torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).sum()  # noqa: E731
    kept, out = saved_bytes(fn)
    logits_bytes = logits.numel() * 2
    assert kept < logits_bytes * 1.05, (kept, logits_bytes)  # measured before: 2.00× and 1.97×; now 1.0001×
    grad, = torch.autograd.grad(out, logits)
    expected, = torch.autograd.grad(reference(), logits)
    torch.testing.assert_close(grad.float(), expected.float(), atol=1e-6, rtol=1e-2)  # bf16 gradients: 1 ulp


# ------------------------------------------------------------------------------------------------
# One gradient all-reduce per optimizer step (DDP: no synchronization on the micro-batches before the last)
# ------------------------------------------------------------------------------------------------
COUNTING = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
import {script} as script

count = [0]

class Counting(script.DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        def hook(state, bucket):
            count[0] += 1
            return allreduce_hook(dist.group.WORLD, bucket)
        self.register_comm_hook(None, hook)

script.DistributedDataParallel = Counting
script.main(script.tyro.cli(script.Args, args=sys.argv[1:]))
with open(f"count.{{os.environ['RANK']}}", "w") as f:
    json.dump(count[0], f)
"""


@pytest.mark.parametrize("script,flags", [  # rlhf_ppo: two trained models, the case with most to get wrong
    ("rlhf_ppo", ["--num-iterations", "1", "--batch-size", "8", "--mini-batch-size", "8", "--ppo-epochs", "1",
                  "--eval-size", "2", "--response-length", "6"]),
])
def test_one_gradient_all_reduce_per_optimizer_step(tiny_checkpoints, tmp_path, script, flags):
    """2 ranks, 2 micro-batches per optimizer step: the DDP communication hook runs as often as with 1 micro-batch
    per step (it ran twice as often when every micro-batch synchronized)."""
    if script == "rlhf_ppo":
        models = tiny_checkpoints["cwd"] / "models"
        flags = [*flags, "--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model")]
    (tmp_path / "counting.py").write_text(COUNTING.format(root=ROOT, script="scale." + script))
    counts = []
    for accumulation in ("1", "2"):
        cwd = tmp_path / accumulation
        cwd.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo, on any machine
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(tmp_path / "counting.py"), *flags, "--gradient-accumulation-steps", accumulation,
                               "--output-dir", "out"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts.append([json.load(open(cwd / f"count.{rank}")) for rank in (0, 1)])
    assert counts[0][0] > 0 and counts[1] == counts[0], counts


# ------------------------------------------------------------------------------------------------
# Saving: the checkpoint's own dtype by default, --save-dtype, one line when it cannot be written
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["sft.py", "scale/sft.py"])  # save_dtype_of: one text in all ten LM scripts
def test_a_bf16_checkpoint_is_saved_in_bf16_and_save_dtype_overrides(script, tmp_path):
    base = save_checkpoint(str(tmp_path / "base"), "llama", "bos", "bfloat16")
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    common = ["--model-name-or-path", base, "--dataset-name", data, "--max-steps", "1", "--batch-size", "4",
              "--eval-every", "1", "--warmup-steps", "0"]
    run_in_process(script, *common, "--output-dir", "own", cwd=tmp_path)
    run_in_process(script, *common, "--output-dir", "fp16", "--save-dtype", "float16", cwd=tmp_path)
    from safetensors import safe_open

    for name, dtype in (("own", torch.bfloat16), ("fp16", torch.float16)):  # neither is float32, the training weights'
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}, name
        assert json.load(open(tmp_path / name / "config.json"))["dtype"] == str(dtype).split(".")[1]
    assert_one_line_error(run_script(script, *common, "--save-dtype", "int8", cwd=tmp_path, check=False),
                          "--save-dtype", "bfloat16")


@pytest.mark.parametrize("script", ["sft.py", "reward_model.py", "dpo.py", "rlhf_ppo.py", "grpo.py", "scale/sft.py",
                                    "scale/reward_model.py", "scale/dpo.py", "scale/rlhf_ppo.py", "scale/grpo.py"])
def test_every_copy_of_save_dtype_of_takes_the_flag_then_the_checkpoints_dtype(script, tmp_path):
    """save_dtype_of in each script (the test above runs two of them end to end): --save-dtype float16 over a bf16
    checkpoint gives float16; without the flag, the checkpoint's bfloat16; a model built from scratch, float32."""
    import importlib

    module = importlib.import_module(script[: -len(".py")].replace("/", "."))
    base = save_checkpoint(str(tmp_path / "base"), "llama", "bos", "bfloat16")
    assert module.save_dtype_of(module.Args(save_dtype="float16"), base) == torch.float16
    assert module.save_dtype_of(module.Args(save_dtype=None), base) == torch.bfloat16
    assert module.save_dtype_of(module.Args(save_dtype=None), None) == torch.float32


def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "blocker").write_text("a file where the output's parent directory should be")
    proc = run_script("scale/sft.py", "--max-steps", "1", "--eval-size", "2", "--num-train-examples", "64",
                      "--output-dir", "blocker/sft", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "cannot write the checkpoint", "blocker/sft", "nothing was saved")
    assert not list(tmp_path.glob("blocker*.tmp-*"))


# ------------------------------------------------------------------------------------------------
# The smaller points
# ------------------------------------------------------------------------------------------------
def test_grpo_clipfrac_counts_only_where_the_clip_is_active():
    """Ratios out of the band count only on the side the advantage pushes them (TRL's is_low/high_clipped)."""
    ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    advantages = torch.tensor([1.0, -1.0])  # row 0 pushes the ratio up, row 1 down
    low, high = grpo.clipped_tokens(ratio, advantages, 0.2, 0.28, "grpo")
    assert low.tolist() == [[False, False, False], [True, False, False]]  # row 1: 0.5 < 1 − 0.2, Â < 0
    assert high.tolist() == [[False, False, True], [False, False, False]]  # row 0: 1.5 > 1 + 0.28, Â > 0
    assert grpo.clipped_tokens(torch.tensor([[1.25]]), torch.tensor([1.0]), 0.2, 0.28, "grpo")[1].tolist() == [[False]]
    # CISPO caps the weight above ε_high itself (TRL's) whatever the advantage's sign, and has no lower bound
    low, high = grpo.clipped_tokens(ratio, advantages, 0.2, 1.28, "cispo")
    assert not low.any() and high.tolist() == [[False, False, True], [False, False, True]]


def test_sampling_keeps_the_models_generation_config(tmp_path):
    """generate replaced model.generation_config, so a saved policy lost the base model's (its top_p, its eos)."""
    path = save_checkpoint(str(tmp_path / "m"), "llama", "bos", "float32", generation={"top_p": 0.8, "do_sample": True})
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    before = model.generation_config.to_dict()
    sequences, _, width, mask, _ = rlhf_ppo.generate(model, [[1, 5, 6]], 0, [2], 4, temperature=0.7)
    assert model.generation_config.to_dict() == before and before["top_p"] == 0.8
    assert sequences.shape == (1, width + mask.shape[1]) and mask.shape[1] <= 4


def test_heads_compute_in_float32_under_autocast():
    """A value or a reward under --bf16 was a bf16 number (3 significant digits); now float32, from the same
    bf16 hidden states."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=0))
    ids = torch.randint(1, 50, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = rlhf_ppo.scalar_head(model, ids, torch.ones_like(ids))
        hidden = model.base_model(input_ids=ids).last_hidden_state
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, (hidden.float() @ model.score.weight.T).squeeze(-1), atol=1e-6, rtol=0)
    assert (scores - scores.bfloat16().float()).abs().max() > 0  # more digits than bf16 holds


def test_a_hub_dataset_config_name_reaches_the_loader(tmp_path):
    """--dataset-config picks one of a dataset's configs (gsm8k "main"): a local dataset repository with two."""
    repo = tmp_path / "repo"
    for config, completion in (("main", "4"), ("socratic", "two plus two is 4")):
        (repo / config).mkdir(parents=True)
        (repo / config / "train.jsonl").write_text(
            "".join(json.dumps({"prompt": f"2+2 #{i}", "completion": completion}) + "\n" for i in range(20)))
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files: main/train.jsonl\n"
                                    "- config_name: socratic\n  data_files: socratic/train.jsonl\n---\n")
    train, _, _ = sft.load_rows(str(repo), "socratic", "train")
    assert {row["completion"] for row in train} == {"two plus two is 4"}
    train, _, _ = sft.load_rows(str(repo), "main", "train")
    assert {row["completion"] for row in train} == {"4"}


def test_fsdp_bf16_mixed_precision_policy_keeps_the_kl_exactly_zero(tiny_checkpoints, tmp_path):
    """2 ranks, --fsdp --bf16: FSDP2's MixedPrecisionPolicy (no autocast) on the actor and critic, the reference
    and reward model sharded too; the KL before the first update is exactly 0 and the first ratio exactly 1."""
    from test_distributed import torchrun

    models = tiny_checkpoints["cwd"] / "models"
    torchrun("scale/rlhf_ppo.py", "--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
             "--num-iterations", "1", "--batch-size", "16", "--mini-batch-size", "8", "--gradient-accumulation-steps",
             "2", "--eval-size", "9", "--generation-batch-size", "3", "--fsdp", "--bf16", cwd=tmp_path)
    logs = scalars_of(tmp_path, "rlhf_ppo")
    assert logs["objective/kl"][0] == (1, 0.0) and logs["objective/kl_k3"][0] == (1, 0.0)
    assert logs["eval/kl"][0] == (0, 0.0)
    assert logs["policy/first_ratio_max_error"][0] == (1, 0.0)
    state(tmp_path / "models" / "rlhf_ppo")


# ------------------------------------------------------------------------------------------------
# The CUDA sampling loop (a static cache, the step as a CUDA graph, tokens drawn on the device): the same
# tokens and log-probs as the eager loop, checked on the CPU with the same steps run one by one, and with the
# graph itself where a GPU is there. Float32, TF32 off: the two loops sum in other orders, nothing more.
# ------------------------------------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def left_padded(prompts, pad, device):
    width = max(map(len, prompts))
    return (torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "llama", "gpt_neox"])
def test_the_graphed_loop_samples_the_greedy_tokens_of_the_eager_loop(arch, device, request):
    """Greedy decoding: the same tokens from sample_tokens_graphed as from sample_tokens, prompts of unequal
    length (left padding) and a stop token that ends some rows early (padding after it, the loop ending once all
    rows stopped, looked at every 2 steps here)."""
    from lm_models import make_model

    # The new API, as the scripts set it: torch refuses to read allow_tf32 once fp32_precision was set.
    precision = torch.backends.cuda.matmul.fp32_precision
    request.addfinalizer(lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", precision))
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # float32 products in float32 on CUDA
    torch.manual_seed(0)
    model = make_model(arch, 400).to(device).eval()
    input_ids, mask = left_padded([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [10, 11], [40, 41, 42, 43]], 0, device)
    never = torch.tensor([-1], device=device)
    with torch.no_grad():
        free, _ = grpo.sample_tokens(model, input_ids, mask, never, 0, 24, 1.0, True)
        stops = free[[0, 2], 3].unique()  # two rows stop early, the others may later or never
        eager, eager_logprobs = grpo.sample_tokens(model, input_ids, mask, stops, 0, 24, 1.0, True)
        graphed, graphed_logprobs = grpo.sample_tokens_graphed(model, input_ids, mask, stops, 0, 24, 1.0, True,
                                                               graph=device == "cuda", check_every=2)
    assert (eager == 0).any(), "no row stopped early: the test would not see the padding"
    assert torch.equal(graphed, eager), (graphed, eager)
    valid = (eager != 0).float()  # each drawn token's log-prob, as both loops computed it (not after a row's stop)
    assert torch.allclose(graphed_logprobs * valid, eager_logprobs * valid, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_with_sliding_window_layers_samples_with_the_eager_loop(device):
    """A Qwen2 whose second layer attends through a sliding window of 4 tokens (as Mistral's and Gemma 2's do):
    transformers' static cache keeps a rolling window there that the graphed loop's masks do not describe, so it
    hands the model to the eager loop, and sequences longer than the window come out as the eager loop's."""
    from lm_models import make_model

    torch.manual_seed(0)
    model = make_model("qwen2", 400, use_sliding_window=True, sliding_window=4, max_window_layers=1).to(device).eval()
    input_ids, mask = left_padded([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]], 0, device)
    never = torch.tensor([-1], device=device)
    with torch.no_grad():
        eager, _ = grpo.sample_tokens(model, input_ids, mask, never, 0, 12, 1.0, True)
        graphed, _ = grpo.sample_tokens_graphed(model, input_ids, mask, never, 0, 12, 1.0, True, graph=device == "cuda")
    assert torch.equal(graphed, eager), (graphed, eager)


def test_the_graphed_loop_samples_from_the_policy_it_trains():
    """At temperature 0.7 the graphed loop's log-prob of each token it drew (read at each step of its forward,
    and as it returns them: the sampler's log-probs) is the log-prob the update computes for that token
    (policy_logprobs: one pass over prompt + response), to 1e-5: the cache, mask and positions of the steps are the
    model's."""
    from lm_models import make_model

    torch.manual_seed(0)
    model = make_model("qwen2", 400).eval()
    input_ids, mask = left_padded([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [10, 11]], 0, "cpu")
    steps = []
    model.register_forward_hook(lambda module, args, out: steps.append(out.logits[:, -1].float()))
    with torch.no_grad():
        responses, returned = grpo.sample_tokens_graphed(model, input_ids, mask, torch.tensor([-1]), 0, 12, 0.7, False,
                                                         graph=False)
        assert len(steps) == 12  # the prompt's pass and 11 steps, each giving the next token's logits
        sampled = torch.stack([torch.log_softmax(z / 0.7, -1) for z in steps], 1).gather(2, responses[..., None])[..., 0]
        sequences, full_mask = torch.cat([input_ids, responses], 1), torch.cat([mask, torch.ones_like(responses)], 1)
        trained, _ = grpo.policy_logprobs(model, sequences, full_mask, input_ids.shape[1], 0.7)
    assert torch.allclose(sampled, trained, atol=1e-5, rtol=0), (sampled - trained).abs().max()
    assert torch.equal(returned, sampled)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_tokens_draws_from_the_tempered_softmax(device):
    """The exponential race: 200,000 draws from softmax(z / 0.5) land on each token with its probability (to
    0.005: about 4 standard errors), each returned with its log-probability; greedy is the argmax."""
    torch.manual_seed(0)
    z = torch.tensor([1.0, 0.5, 0.0, -1.0, 0.8], device=device)
    tokens, logprobs = grpo.draw_tokens(z.expand(200_000, 5), 0.5, False)
    frequency = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert torch.allclose(frequency, torch.softmax(z / 0.5, -1), atol=0.005, rtol=0), frequency
    assert torch.allclose(logprobs, torch.log_softmax(z / 0.5, -1)[tokens])
    greedy, logprob = grpo.draw_tokens(z[None], 0.5, True)
    assert greedy.tolist() == [0] and logprob.item() == pytest.approx(torch.log_softmax(z / 0.5, -1)[0].item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("script,flags", [
    ("scale/grpo.py", ["--num-generations", "4", "--lora-r", "4"]),
    ("scale/rlhf_ppo.py", ["--reward-model-path", "REWARD_MODEL"]),
])
def test_the_scripts_sample_with_the_cuda_graph_on_one_gpu(tiny_checkpoints, tmp_path, monkeypatch, script, flags):
    """On CUDA (--bf16 by default) every rollout and evaluation of scale/grpo.py (with LoRA adapters) and
    scale/rlhf_ppo.py samples through sample_tokens_graphed, and the run trains: finite losses, the first ratio
    exactly 1 (the rollout's log-probs recomputed by the update), the KL to the reference 0 before the first update."""
    import importlib

    module = importlib.import_module(script[:-3].replace("/", "."))
    calls = []
    real = module.sample_tokens_graphed
    monkeypatch.setattr(module, "sample_tokens_graphed", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(module, "sample_tokens", None)  # the eager loop must not run
    models = tiny_checkpoints["cwd"] / "models"
    flags = [str(models / "reward_model") if f == "REWARD_MODEL" else f for f in flags]
    run_in_process(script, "--model-name-or-path", str(models / "sft"), *flags, "--num-iterations", "2", "--batch-size", "16",
                   "--mini-batch-size", "8", "--eval-size", "16", "--eval-every", "2", "--output-dir", "out", cwd=tmp_path)
    logs = scalars_of(tmp_path, script[6:-3])
    assert len(calls) >= 4  # 2 rollouts, 2 evaluations
    assert logs["policy/first_ratio_max_error"][0] == (1, 0.0) and logs["eval/kl"][0] == (0, 0.0)
    assert all(math.isfinite(v) for tag, values in logs.items() for _, v in values), logs
