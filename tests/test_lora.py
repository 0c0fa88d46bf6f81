"""LoRA (--lora-r): the flags shape every adapter as in the paper's equation; only the adapters and a scalar head
train; the reference is the policy with its adapters off, exactly the base model; the merged save reproduces the
adapter model; it resumes exactly, runs under torchrun, and a copied script runs without peft."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    CPU_FLOAT32,
    ROOT,
    TINY_LM,
    assert_one_line_error,
    module_name,
    only_run_dir,
    read_scalars,
    run_in_process,
    run_script,
)
from test_distributed import torchrun
from test_resume import check_exact_resume, lm_flags, one_line_exit

# peft is looked for, not imported: importing it would cost every pytest worker about 1.5 s of collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="--lora-r needs peft (requirements.txt)")


def trained_model_of(script, flags, cwd, monkeypatch):
    """Run a script in this process and return the model it hands to save_model (a peft model)."""
    import importlib

    module = importlib.import_module(module_name(script))
    captured = []
    real = module.save_model
    monkeypatch.setattr(module, "save_model", lambda model, *a: (captured.append(model), real(model, *a)))
    run_in_process(script, *CPU_FLOAT32, *flags, cwd=cwd)
    return captured[0]


@pytest.mark.parametrize("script", ["scale/reward_model.py", "scale/rlhf_ppo.py"])
def test_only_the_adapters_and_the_head_change(tiny_checkpoints, tmp_path, monkeypatch, script):
    """After training with --lora-r 4: every base weight is the checkpoint's, bitwise; every LoRA B (zero at the
    start) and the reward model's score head have moved."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    models = tiny_checkpoints["cwd"] / "models"
    if script == "scale/reward_model.py":
        flags = ["--model-name-or-path", str(models / "sft"), "--max-steps", "10", "--num-train-pairs", "200",
                 "--eval-size", "8", "--batch-size", "8", "--eval-every", "10", "--lr", "1e-2"]
        base = AutoModelForSequenceClassification.from_pretrained(models / "sft", num_labels=1)
    else:
        flags = ["--model-name-or-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
                 "--num-iterations", "2", "--batch-size", "16", "--mini-batch-size", "8", "--eval-size", "8",
                 "--eval-every", "2", "--lr", "1e-2"]
        base = AutoModelForCausalLM.from_pretrained(models / "sft")
    model = trained_model_of(script, [*flags, "--lora-r", "4", "--output-dir", "models/m"], tmp_path, monkeypatch)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or "modules_to_save" in name for name in trained)
    state = model.get_base_model().state_dict()
    original = base.state_dict()
    frozen = {k.replace(".base_layer", "").replace(".original_module", ""): v for k, v in state.items()
              if "lora_" not in k and "modules_to_save" not in k}
    head = "score.weight" if script == "scale/reward_model.py" else None
    for name, value in original.items():
        if name == head:  # a new head, random at the start: only its trained copy moves
            continue
        assert torch.equal(frozen[name].cpu(), value), name  # the model may be on a GPU
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)
    if head:
        assert not torch.equal(state["score.modules_to_save.default.weight"], state["score.original_module.weight"])


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft 0.21's PeftModel on transformers 5.24
def test_adapters_off_is_the_base_model_and_the_merged_save_is_the_adapter_model(tiny_checkpoints, tmp_path):
    """dpo.py with --lora-r: the reference (the policy with its adapters off, in AdaptersOff) gives the base
    model's logits bitwise after training, while the adapters change them; KL and the DPO margin are exactly 0
    before the first update; the adapter directory and the --merge-lora directory give the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from scale import dpo

    models = tiny_checkpoints["cwd"] / "models"
    flags = ["--model-name-or-path", str(models / "sft"), "--reward-model-path", "None", "--max-steps", "10",
             "--batch-size", "8", "--num-train-pairs", "200", "--eval-size", "8", "--eval-every", "10",
             "--lr", "1e-2", "--lora-r", "4", "--lora-dropout", "0.1"]
    run_script("scale/dpo.py", *CPU_FLOAT32, *flags, "--output-dir", "models/adapter", cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert scalars["train/margin"][0] == (1, 0.0) and scalars["eval/kl"][0] == (0, 0.0)
    assert scalars["eval/kl"][-1][1] != 0.0  # the reference did not follow the policy
    run_script("scale/dpo.py", *CPU_FLOAT32, *flags, "--merge-lora", "--output-dir", "models/merged", cwd=tmp_path)
    assert not (tmp_path / "models" / "adapter" / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(models / "sft").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models / "sft"),
                                        tmp_path / "models" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "merged").eval()
    ids = torch.tensor([[5, 17, 30, 9, 12, 40, 7]])
    with torch.no_grad():
        reference = dpo.AdaptersOff(adapted)(input_ids=ids).logits
        on = adapted(input_ids=ids).logits
        assert torch.equal(reference, base(input_ids=ids).logits)
        assert not torch.allclose(on, reference, atol=1e-4)
        torch.testing.assert_close(merged(input_ids=ids).logits, on, rtol=0, atol=1e-5)


def test_exact_resume_with_lora(tiny_checkpoints, tmp_path):
    """rlhf_ppo.py's actor and critic both adapted, the critic's head trained whole: the checkpoint holds the adapters
    and the head only (the frozen weights come from the model paths), and the run resumes exactly."""
    flags, n = lm_flags("scale/rlhf_ppo.py", tiny_checkpoints["cwd"] / "models")
    check_exact_resume("scale/rlhf_ppo.py", [*flags, "--lora-r", "4", "--merge-lora"], n, tmp_path)


def test_lora_under_torchrun_ddp_is_the_one_process_update(tmp_path):
    """sft.py --lora-r on 2 gloo ranks (DDP over the adapters) logs the one-process loss and gradient norm."""
    flags = [*CPU_FLOAT32, *TINY_LM, "--max-steps", "10", "--batch-size", "8", "--num-train-examples", "200", "--eval-size", "4",
             "--eval-every", "10", "--lora-r", "4", "--lr", "1e-2", "--merge-lora", "--output-dir", "models/m"]
    logs = {}
    for name, run in (("one", run_script), ("two", torchrun)):
        os.makedirs(tmp_path / name)
        run("scale/sft.py", *flags, cwd=tmp_path / name)
        logs[name] = read_scalars(only_run_dir(tmp_path / name))
    for tag in ("losses/loss", "train/grad_norm"):
        assert [s for s, _ in logs["one"][tag]] == [s for s, _ in logs["two"][tag]] == [10]
        assert logs["two"][tag][0][1] == pytest.approx(logs["one"][tag][0][1], rel=1e-4)


SCALE_SCRIPTS = ["scale/sft.py", "scale/reward_model.py", "scale/dpo.py", "scale/rlhf_ppo.py", "scale/grpo.py"]


def lora_args(script, **flags):
    import importlib

    module = importlib.import_module(module_name(script))
    return module, module.Args(**flags)


@pytest.mark.slow  # imports peft, about 1.5 s that the fast tier does not pay
@pytest.mark.parametrize("script", SCALE_SCRIPTS)
def test_the_lora_flags_shape_every_adapter(script):
    """Each script's add_lora on a tiny Llama: --lora-target-modules q_proj v_proj adapts those layers and no other
    (by default every linear layer but the output head); each adapted layer computes h = W₀x + (α/r)·B·A·x (Hu et
    al. 2021, eq. 3), A of rank --lora-r, here computed by hand with --lora-r 3 and --lora-alpha 6 (scale 2; with
    --lora-alpha's default 32 it would be 32/3, with --lora-r's default 8, 6/8); --lora-dropout drops the adapters'
    input."""
    from lm_models import make_model

    torch.manual_seed(0)
    module, args = lora_args(script, lora_r=3, lora_alpha=6.0, lora_dropout=0.25, lora_target_modules=("q_proj", "v_proj"))
    model = module.add_lora(make_model("llama", 64), args)
    adapted = sorted(name.split(".")[-2] for name, _ in model.named_modules() if name.endswith(".lora_A"))
    assert adapted == ["q_proj", "q_proj", "v_proj", "v_proj"]  # 2 layers
    layer = model.get_base_model().model.layers[1].self_attn.q_proj
    A, B, W0 = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer.weight
    assert A.shape == (3, 32) and B.shape == (32, 3) and not B.any()  # B = 0: the model is unchanged at the start
    assert layer.lora_dropout["default"].p == 0.25
    with torch.no_grad():
        B.normal_()
        x = torch.randn(5, 32)
        torch.testing.assert_close(layer.eval()(x), x @ W0.T + 2.0 * (x @ A.T @ B.T), rtol=0, atol=1e-5)
    _, default = lora_args(script, lora_r=3)
    default_model = module.add_lora(make_model("llama", 64), default)
    adapted = {name.split(".")[-2] for name, _ in default_model.named_modules() if name.endswith(".lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("script", SCALE_SCRIPTS)
def test_merge_lora_saves_a_plain_model_that_computes_the_adapted_one(script, tmp_path):
    """Each script's save_model: with --merge-lora, a checkpoint of the base architecture (no adapter files) whose
    logits are the adapted model's; without it, the adapter alone."""
    from lm_models import make_model, make_tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.tensor([[5, 17, 30, 9, 12]])
    for merge in (True, False):
        module, args = lora_args(script, lora_r=4, merge_lora=merge)
        model = module.add_lora(make_model("llama", 64), args).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
            adapted = model(input_ids=ids).logits
        out = str(tmp_path / f"merged-{merge}")
        module.save_model(model, make_tokenizer("eos_no_pad"), args, out, torch.float32)
        assert os.path.exists(os.path.join(out, "config.json")) == merge
        assert os.path.exists(os.path.join(out, "adapter_config.json")) == (not merge)
        if merge:
            saved = AutoModelForCausalLM.from_pretrained(out).eval()
            with torch.no_grad():
                torch.testing.assert_close(saved(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flags,words", [
    (["--merge-lora"], ["--merge-lora", "pass --lora-r"]),
    (["--lora-r", "4", "--fsdp"], ["--lora-r with --fsdp"]),
    (["--lora-r", "-1"], ["--lora-r must be ≥ 0"]),
])
def test_bad_lora_flags_are_one_line(tmp_path, flags, words):
    message = one_line_exit("scale/sft.py", *TINY_LM, *flags, cwd=tmp_path)
    assert all(word in message for word in words), message
    assert not os.path.exists(tmp_path / "runs")


def test_a_copied_script_runs_without_peft(tmp_path):
    """peft is imported only under --lora-r: with it made unimportable, sft.py trains; with --lora-r it says what to
    install, in one line."""
    code = ("import runpy, sys; sys.modules['peft'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    base = [sys.executable, "-c", code, os.path.join(ROOT, "scale/sft.py"), *TINY_LM, "--max-steps", "2", "--num-train-examples",
            "50", "--eval-size", "2", "--eval-every", "2", "--batch-size", "4"]
    subprocess.run(base, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    proc = subprocess.run([*base, "--lora-r", "4"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "--lora-r needs peft: pip install peft")
