"""LoRA (--lora-r): only the adapters and a scalar head train; the reference is the policy with its adapters off,
exactly the base model; the merged save reproduces the adapter model; it resumes exactly, runs under torchrun,
and a copied script runs without peft."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import CPU_FLOAT32, ROOT, TINY_LM, assert_one_line_error, module_name, only_run_dir, read_scalars, run_in_process, run_script
from test_distributed import torchrun
from test_resume import check_exact_resume, lm_flags, one_line_exit

# peft is looked for, not imported: importing it would cost every pytest worker about 1.5 s of collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="--lora-r needs peft (requirements.txt)")


def trained_model_of(script, flags, cwd, monkeypatch):
    """Run a script in this process and return the model it hands to save_atomically (a peft model)."""
    import importlib

    module = importlib.import_module(module_name(script))
    captured = []
    real = module.save_atomically
    monkeypatch.setattr(module, "save_atomically", lambda model, *a: (captured.append(model), real(model, *a)))
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
        flags = ["--sft-model-path", str(models / "sft"), "--reward-model-path", str(models / "reward_model"),
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
    from scale import dpo
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

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
