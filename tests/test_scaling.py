"""The 8-GPU path, on what a CPU can show: rank 0 alone reads a checkpoint and the other ranks receive the weights
(DDP) or only their shards (FSDP2); frozen FSDP roots reshard; every rank sees the run directory; the memory-safe
defaults (evaluation at the micro-batch size, no gradients through the rollout, --bf16 and
--gradient-checkpointing settled by the machine and --fsdp, the KV cache checked before sampling on CUDA); the LM
head in chunks of positions (head_logprobs), equal to one whole pass and keeping no logits for the backward pass."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY_LM, module_name, read_scalars, run_in_process
from lm_models import save_checkpoint

from scale import dpo, grpo, reward_model, rlhf_ppo, sft

LM_SCRIPTS = [sft, reward_model, dpo, rlhf_ppo, grpo]


# ------------------------------------------------------------------------------------------------
# Loading: rank 0 reads, the others build on the meta device and receive
# ------------------------------------------------------------------------------------------------
def _place_on_rank(rank, init_file, cases, out_file):
    """On each of 2 gloo ranks: load_model + prepare_models + place_model as the scripts do, then one forward pass of
    the same tokens; rank 0 also computes them with its model as loaded, before placing, and shares them."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = []
    for path, head, fsdp, trained in cases:
        args = type("Args", (), {"fsdp": fsdp, "bf16": False})()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = dpo.load_no_dropout(path, head, torch.float32, dpo.load_config(path, head))
        on_meta = all(p.is_meta for p in model.parameters())
        dpo.prepare_models(tokenizer, dpo.stop_token_ids(tokenizer), [model], [] if trained else [model])
        x = torch.tensor([[1, 5, 9, 13, 2, 7], [3, 4, 8, 6, 11, tokenizer.pad_token_id]])
        model.eval()
        expected = model(input_ids=x).logits.detach() if rank == 0 else torch.zeros(1)
        shape = [list(expected.shape)]
        dist.broadcast_object_list(shape, src=0)
        expected = expected if rank == 0 else torch.zeros(shape[0])
        dist.broadcast(expected, src=0)
        whole = sum(p.numel() for p in model.parameters())
        placed = dpo.place_model(model, torch.device("cpu"), args, trained=trained)
        inner = getattr(placed, "module", placed)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in placed.parameters())
        with torch.no_grad():
            logits = placed(input_ids=x).logits
        tied = (inner.get_output_embeddings() is not None
                and inner.get_output_embeddings().weight is inner.get_input_embeddings().weight)
        results.append({"on_meta": on_meta, "error": (logits - expected).abs().max().item(), "tied": tied,
                        "local": local, "whole": whole,
                        "sharded_after_forward": all(isinstance(p, DTensor) for p in placed.parameters())})
    torch.save(results, f"{out_file}.{rank}")
    dist.destroy_process_group()


def test_only_rank_0_reads_the_weights_and_every_rank_computes_with_them(tmp_path):
    """2 gloo ranks, the scripts' load_model, prepare_models and place_model. Rank 1 builds each model on the meta
    device (it never holds one whole before placing); after placing, both ranks compute exactly what rank 0's model
    computed as loaded: under DDP and FSDP2, for a bf16 Llama checkpoint (untied; the rotary inv_freq is a buffer
    outside the state dict), a Qwen2 with tied embeddings grown for a new pad token, and a GPT-2 loaded with a new
    scalar head (initialised at random on rank 0 only). Tied weights stay one tensor; under FSDP each rank holds
    about half the weights, and a frozen model's root is resharded after its forward (nothing stays gathered)."""
    llama = save_checkpoint(str(tmp_path / "llama"), "llama", "eos_no_pad", "bfloat16")
    qwen = save_checkpoint(str(tmp_path / "qwen"), "qwen2", "bos", "float32", tie_word_embeddings=True)
    gpt2 = save_checkpoint(str(tmp_path / "gpt2"), "gpt2", "pad_is_eos", "float32")
    cases = [(path, head, fsdp, trained) for fsdp in (False, True)
             for path, head, trained in ((llama, "lm", True), (qwen, "lm", False), (gpt2, "score", True))]
    torch.multiprocessing.spawn(_place_on_rank, args=(str(tmp_path / "init"), cases, str(tmp_path / "out")), nprocs=2)
    results = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    for (path, head, fsdp, trained), r0, r1 in zip(cases, *results):
        case = f"{os.path.basename(path)} {head} {'fsdp' if fsdp else 'ddp'}"
        assert not r0["on_meta"] and r1["on_meta"], case
        assert r0["error"] == 0 and r1["error"] == 0, (case, r0["error"], r1["error"])
        if os.path.basename(path) in ("qwen", "gpt2") and head == "lm":
            assert r0["tied"] and r1["tied"], case
        if fsdp:
            assert r0["local"] + r1["local"] >= r0["whole"] and max(r0["local"], r1["local"]) < 0.6 * r0["whole"], case
            assert r0["sharded_after_forward"] == r1["sharded_after_forward"] == (not trained), case
        else:
            assert r0["local"] == r1["local"] == r0["whole"], case


def test_a_rank_that_does_not_see_the_run_directory_stops_every_rank(tmp_path):
    """Two ranks on one machine, each started in a directory of its own (as two nodes without a shared
    filesystem): rank 1 does not see the run directory rank 0 made, and the run stops before any training with one
    line from the first rank of each node, no run directory left behind."""
    from test_distributed import rank_output

    wrapper = tmp_path / "own_directory.py"
    wrapper.write_text("import os, runpy, sys\nos.makedirs(f\"node{os.environ['RANK']}\", exist_ok=True)\n"
                       "os.chdir(f\"node{os.environ['RANK']}\")\nsys.argv = sys.argv[1:]\n"
                       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
           str(tmp_path / "torchrun_logs"), "--redirects", "3", str(wrapper), os.path.join(ROOT, "scale/sft.py"), *TINY_LM,
           "--max-steps", "2", "--batch-size", "4", "--num-train-examples", "20", "--eval-size", "4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = rank_output(tmp_path, 0, "stderr").strip().splitlines()
    assert errors and errors[-1].startswith("error: 1 of 2 ranks do not see the run directory 'runs/sft__1__"), errors
    assert "filesystem they share" in errors[-1] and "Traceback" not in rank_output(tmp_path, 0, "stderr")
    assert not (tmp_path / "node0" / "runs").exists() or not any((tmp_path / "node0" / "runs").iterdir())
    assert not (tmp_path / "node0" / "models").exists()


# ------------------------------------------------------------------------------------------------
# Memory-safe defaults
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", LM_SCRIPTS, ids=lambda m: m.__name__)
def test_defaults_settled_by_the_machine_and_fsdp(script, monkeypatch):
    """--bf16: on where CUDA computes in bfloat16, off on the CPU or with --no-cuda; --gradient-checkpointing: on
    under --fsdp; a flag given either way is kept."""
    import tyro

    def settled(*flags):
        args = tyro.cli(script.Args, args=list(flags))
        script.settle_defaults(args)
        return args.bf16, args.gradient_checkpointing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert settled() == (False, False)
    assert settled("--fsdp") == (False, True)
    assert settled("--fsdp", "--no-gradient-checkpointing", "--bf16") == (True, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert settled() == (True, False)
    assert settled("--no-bf16", "--gradient-checkpointing") == (False, True)
    assert settled("--no-cuda") == (False, False)


@pytest.mark.parametrize("script", [rlhf_ppo, grpo], ids=lambda m: m.__name__)
def test_the_kv_cache_is_checked_before_sampling_on_cuda(script, monkeypatch):
    """A Llama-3-8B-shaped config (32 layers, 8 KV heads of 128): 256 rows × 1,536 tokens under --bf16 over
    float32 weights are 32·8·128·256·1536·(4 + 2) bytes = 72 GiB of KV cache (float32 keys, bf16 values): one
    line with a size that fits when 40 GiB are free, nothing when 150 GiB are, and nothing on the CPU; with bf16
    weights 48 GiB."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    model = type("Model", (), {"config": config, "dtype": torch.float32})()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, 80 * 2**30))
    with pytest.raises(SystemExit) as stop:
        script.check_kv_cache(model, 256, 1536, cuda, bf16=True)
    assert str(stop.value.code) == ("error: --generation-batch-size 256 × 1536 tokens needs a KV cache of 72.0 GiB, "
                                    "more than half the 40.0 GiB free on the GPU; pass --generation-batch-size 71 or less")
    script.check_kv_cache(model, 71, 1536, cuda, bf16=True)  # 20.0 GiB: fits in half of 40
    model.dtype = torch.bfloat16
    assert script.kv_cache_bytes(model, 256, 1536, bf16=True) == 48 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (150 * 2**30, 160 * 2**30))
    script.check_kv_cache(model, 256, 1536, cuda, bf16=True)
    script.check_kv_cache(model, 10**6, 1536, torch.device("cpu"), bf16=True)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt_neox"])
@pytest.mark.parametrize("bf16", [True, False])
def test_the_kv_cache_is_counted_as_autocast_stores_it(arch, bf16):
    """kv_cache_bytes is what a forward pass stores, counted on the CPU: float32 weights, with or without bf16
    autocast, 3 rows × 7 tokens into transformers' cache."""
    from lm_models import make_model
    from transformers import DynamicCache

    model = make_model(arch, 400)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        model(input_ids=torch.randint(0, 400, (3, 7)), use_cache=True, **{grpo.CACHE: cache})
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert grpo.kv_cache_bytes(model, 3, 7, bf16) == stored


def test_cuda_settings_leave_a_users_allocator_setting(monkeypatch):
    """PyTorch's expandable segments by default, a PYTORCH_CUDA_ALLOC_CONF the user set kept."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    sft.setup_distributed(cuda=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    sft.setup_distributed(cuda=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


@pytest.mark.parametrize("script,flags", [
    ("scale/sft.py", [*TINY_LM, "--num-train-examples", "40", "--eval-size", "20", "--max-new-tokens", "3"]),
    ("scale/dpo.py", ["--model-name-or-path", "SFT", "--reward-model-path", "None", "--num-train-pairs", "40",
                "--eval-size", "20", "--response-length", "3"]),
    ("scale/reward_model.py", ["--model-name-or-path", "SFT", "--num-train-pairs", "40", "--eval-size", "20"]),
])
def test_evaluation_runs_at_the_micro_batch_size(tiny_checkpoints, tmp_path, monkeypatch, script, flags):
    """Without --eval-batch-size, evaluation samples (sft, dpo) and scores (reward_model: chosen and rejected in one
    pass) at most a training micro-batch at a time: 8 / 2 = 4 here, of 20 eval rows; --eval-batch-size 16 asks
    for more."""
    module = sys.modules[module_name(script)]
    flags = [str(tiny_checkpoints["sft"]) if f == "SFT" else f for f in flags]
    common = [*flags, "--max-steps", "1", "--batch-size", "8", "--gradient-accumulation-steps", "2", "--eval-every", "1",
              "--output-dir", "out"]
    sizes = []
    if script == "scale/reward_model.py":
        original = module.collate
        monkeypatch.setattr(module, "collate", lambda batch, *a: sizes.append(len(batch) // 2) or original(batch, *a))
    else:
        original = module.generate
        monkeypatch.setattr(module, "generate", lambda m, ids, *a, **k: sizes.append(len(ids)) or original(m, ids, *a, **k))
    run_in_process(script, *common, cwd=tmp_path)
    assert sizes and max(sizes) == 4, sizes
    if script == "scale/sft.py":  # the flag itself (the same lines in each script)
        sizes.clear()
        run_in_process(script, *common, "--eval-batch-size", "16", "--exp-name", "big", cwd=tmp_path)
        assert max(sizes) == 16, sizes


@pytest.mark.parametrize("script,flags", [
    ("scale/rlhf_ppo.py", ["--batch-size", "4", "--mini-batch-size", "2", "--ppo-epochs", "1"]),
    ("scale/grpo.py", ["--batch-size", "4", "--num-generations", "2", "--mini-batch-size", "2"]),
])
def test_no_gradients_live_through_a_rollout(tiny_checkpoints, tmp_path, monkeypatch, script, flags):
    """Gradients are freed right after each optimizer step: at every rollout after the first, no trained parameter
    holds a gradient (they would be the size of the trained weights, through the whole sampling)."""
    module = sys.modules[module_name(script)]
    held = []
    original = module.generate_in_chunks

    def recorded(model, *a, **k):
        held.append(sum(p.grad is not None for p in model.parameters()))
        return original(model, *a, **k)

    monkeypatch.setattr(module, "generate_in_chunks", recorded)
    reward = (["--reward-model-path", str(tiny_checkpoints["reward_model"])] if script == "scale/rlhf_ppo.py" else [])
    run_in_process(script, "--model-name-or-path", str(tiny_checkpoints["sft"]), *reward, *flags, "--num-iterations", "3",
                   "--eval-every", "100", "--eval-size", "2", "--response-length", "3", "--output-dir", "out", cwd=tmp_path)
    assert len(held) >= 4 and held == [0] * len(held), held


# ------------------------------------------------------------------------------------------------
# No [batch, length, vocabulary] tensor: the LM head in chunks of positions (head_logprobs)
# ------------------------------------------------------------------------------------------------
def tiny_lm(arch):
    from lm_models import make_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    if arch == "gemma2":  # logit softcapping after the head
        return Gemma2ForCausalLM(Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              final_logit_softcapping=2.0)).eval()
    return make_model(arch, 50, **(dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" else {})).eval()


@pytest.mark.parametrize("head", ["chunks", "whole"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_head_logprobs_equal_the_whole_pass(arch, head, monkeypatch):
    """head_logprobs with chunks of 3 positions (of 2 × 7), or whole as choose_head picks it on a GPU, against one
    pass that makes the whole [2, 7, 50] logits: the same log-probs at temperature 0.7, entropies and gradients of
    every weight, to float rounding; with logits_to_keep, only the kept positions. GPT-2's head is its embedding
    (tied); Gemma 2 softcaps its logits."""
    model = tiny_lm(arch)
    monkeypatch.setattr(dpo, "HEAD_CHUNK_ELEMENTS", 3 * 50)
    monkeypatch.setattr(dpo, "whole_head_elements", 2 * 7 * 50 if head == "whole" else 0)
    ids = torch.randint(1, 50, (2, 7))
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))

    def whole():
        z = model(input_ids=ids).logits.float() / 0.7
        full = torch.log_softmax(z, -1)
        return full.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(full.exp() * full).sum(-1)

    results = []
    for fn in (lambda: dpo.head_logprobs(model, targets, 0.7, True, input_ids=ids), whole):
        model.zero_grad()
        logprobs, entropy = fn()
        logprobs[:, :-1].sum().backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (chunked, chunked_entropy, chunked_grads), (expected, expected_entropy, expected_grads) = results
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_entropy, expected_entropy, atol=1e-5, rtol=0)
    for a, b in zip(chunked_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    kept = dpo.head_logprobs(model, targets[:, -3:], 0.7, input_ids=ids, logits_to_keep=3)
    torch.testing.assert_close(kept, expected[:, -3:], atol=1e-5, rtol=0)


def test_head_logprobs_keep_no_logits_for_the_backward_pass():
    """A vocabulary of 32,000 at 2 × 64 positions: one pass that makes the logits keeps at least their 16 MiB for
    the backward pass; head_logprobs keeps the hidden states and the targets, not the logits (each chunk's are
    recomputed in the backward pass), under a tenth of that."""
    from lm_models import make_model
    from test_gpu_path import saved_bytes

    torch.manual_seed(0)
    model = make_model("llama", 32000)
    ids = torch.randint(0, 32000, (2, 64))
    logits_bytes = 2 * 64 * 32000 * 4
    chunked, _ = saved_bytes(lambda: dpo.head_logprobs(model, ids, input_ids=ids).sum())
    whole, _ = saved_bytes(lambda: torch.log_softmax(model(input_ids=ids).logits, -1).sum())
    assert whole >= logits_bytes and chunked < logits_bytes / 10, (whole, chunked)  # measured: 21.2 MB, 0.7 MB


def test_the_whole_head_keeps_its_logits_and_recomputes_nothing(monkeypatch):
    """Where choose_head allows it, the pass makes its logits once and keeps them for the backward pass (at least
    their 16 MiB saved, as the plain pass), and the backward pass runs the head's forward no more."""
    from lm_models import make_model
    from test_gpu_path import saved_bytes

    torch.manual_seed(0)
    model = make_model("llama", 32000)
    ids = torch.randint(0, 32000, (2, 64))
    calls = []
    model.get_output_embeddings().register_forward_pre_hook(lambda module, inputs: calls.append(1))
    monkeypatch.setattr(dpo, "whole_head_elements", 2 * 64 * 32000)
    kept, _ = saved_bytes(lambda: dpo.head_logprobs(model, ids, input_ids=ids).sum())
    assert kept >= 2 * 64 * 32000 * 4, kept
    model.zero_grad()
    dpo.head_logprobs(model, ids, input_ids=ids).sum().backward()
    assert len(calls) == 2  # one forward each in saved_bytes and here: none again in a backward pass


@pytest.mark.parametrize("script", [sft, dpo, rlhf_ppo, grpo], ids=lambda m: m.__name__)
def test_the_head_is_whole_only_on_a_gpu_without_fsdp_within_an_eighth_of_its_memory(script, monkeypatch, capsys):
    """choose_head: Qwen2.5's vocabulary, 8 × 1024 positions (4.6 GiB of float32 logits): whole on an 80 GiB GPU
    (10 GiB budget), in chunks on a 24 GiB one (3 GiB), under --fsdp, and on the CPU; the choice printed once."""
    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for device, fsdp, memory, whole in ((cuda, False, 80, True), (cuda, False, 24, False), (cuda, True, 80, False),
                                        (cpu, False, 80, False)):
        monkeypatch.setattr(script, "whole_head_elements", 0)
        Properties.total_memory = memory * 2**30
        script.choose_head(device, fsdp, 8, 1024, 151936)
        line = capsys.readouterr().out
        assert line.count("\n") == 1 and line.startswith("LM head: whole" if whole else "LM head: in chunks"), line
        assert "4.64 GiB" in line
        assert (script.whole_head_elements >= 8 * 1024 * 151936) == whole


@pytest.mark.parametrize("script", [sft, reward_model, dpo, rlhf_ppo, grpo], ids=lambda m: m.__name__)
def test_compile_blocks_compiles_each_block_for_the_passes_with_gradients(script, monkeypatch):
    """--compile: torch.compile once per block class (GPT-2's 2 blocks share it); a pass with gradients runs each
    block through it, a pass without (sampling, scoring, evaluation) runs the eager blocks; the same outputs."""
    from lm_models import make_model

    compiled, calls = [], []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *args, **kwargs: calls.append(1) or fn(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", fake_compile)
    torch.manual_seed(0)
    model = make_model("gpt2", 50, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 50, (2, 5))
    expected = model(input_ids=ids).logits
    script.compile_blocks(model)
    assert len(compiled) == 1
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert calls == []
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert len(calls) == 2


def test_a_model_that_changes_its_logits_after_the_head_is_one_line():
    """Cohere scales its logits after the head (logit_scale): log-probs computed in the head would be wrong, so
    head_logprobs stops with one line instead."""
    from transformers import CohereConfig, CohereForCausalLM

    model = CohereForCausalLM(CohereConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5))
    ids = torch.randint(0, 50, (1, 5))
    with pytest.raises(SystemExit) as stop:
        dpo.head_logprobs(model, ids, input_ids=ids)
    assert str(stop.value.code).startswith("error: CohereForCausalLM changes its logits after the LM head")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_on_cuda_the_head_is_whole_and_compile_trains_as_eager(tmp_path, capsys):
    """On one GPU: scale/sft.py says once that it computes the LM head whole, and with --compile (each GPT-2 block
    compiled for the passes with gradients) it trains to the loss it reaches eager, to bfloat16 rounding."""
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        run_in_process("scale/sft.py", *TINY_LM, *extra, "--max-steps", "20", "--num-train-examples", "400",
                       "--eval-size", "0", "--eval-every", "100", "--exp-name", name, "--output-dir", name, cwd=tmp_path)
        out = capsys.readouterr().out
        assert out.count("LM head: whole, kept for the backward pass") == 1, out
        losses[name] = read_scalars(str(next((tmp_path / "runs").glob(f"{name}__*"))))["losses/loss"][-1][1]
    assert abs(losses["compiled"] - losses["eager"]) < 0.02 * losses["eager"], losses
