"""Test helpers: import the scripts from the repo root, run them as a user would, read their logs."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "PYTEST_XDIST_WORKER" in os.environ:  # -n N workers on N cores: one thread each, and so every script they start
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def reward_model_for(src, dst, dataset_name):
    """A copy of the reward model at `src`, in `dst`, whose training_args.json says it was trained for
    `dataset_name`: the tiny reward models of the built-in task standing in for one trained on a dataset (the
    scripts refuse to score a dataset's completions with a reward model of the built-in task)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "training_args.json")) as f:
        flags = json.load(f)
    with open(os.path.join(dst, "training_args.json"), "w") as f:
        json.dump({**flags, "dataset_name": dataset_name}, f)
    return str(dst)


def run_script(script, *flags, cwd, check=True, timeout=600):
    """`python <script> <flags>` in `cwd`, through the script's real entry point (tyro.cli -> main)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(flags)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def only_run_dir(cwd):
    run_dirs = glob.glob(os.path.join(cwd, "runs", "*"))
    assert len(run_dirs) == 1, run_dirs
    return run_dirs[0]


def read_scalars(run_dir):
    """{tag: [(step, value), ...]} of every scalar in a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_one_line_error(proc, *words):
    """Bad input: non-zero exit, a single line on stderr that names the problem, no traceback."""
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


TINY_LM = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2"]
# The device and precision of a test that compares a run's numbers with numbers computed here or in another run:
# the CPU in float32 on any machine (on CUDA the scripts compute in bf16 autocast and TF32 by default)
CPU_FLOAT32 = ["--no-cuda", "--no-bf16"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """A tiny SFT model and a reward model trained from it, made by the scripts themselves: {name: path}. Made
    once for all pytest-xdist workers (the first to ask makes them; the others wait on a lock), and read only:
    tests write their runs and models to their own tmp_path."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root  # the directory all workers share
    cwd = root / "lm"
    with FileLock(str(root / "lm.lock")):
        if not (cwd / "done").exists():
            os.makedirs(cwd, exist_ok=True)
            run_script("sft.py", *TINY_LM, "--max-steps", "30", "--eval-every", "15", "--num-train-examples", "2000",
                       "--eval-size", "32", "--output-dir", "models/sft", cwd=cwd)
            run_script("reward_model.py", "--max-steps", "20", "--eval-every", "10", "--num-train-pairs", "1000",
                       "--eval-size", "32", cwd=cwd)
            (cwd / "done").touch()
    return {"cwd": cwd, "sft": cwd / "models" / "sft", "reward_model": cwd / "models" / "reward_model"}


@pytest.fixture(scope="session")
def small_checkpoints(tmp_path_factory):
    """An SFT model of the built-in task trained long enough (300 steps) that its completions stop and differ in
    gold score, and a reward model trained from it (60 steps; 75% held-out accuracy): what the RL scripts need to
    have something to learn in a few iterations. {name: path}, made once for all pytest-xdist workers."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root
    cwd = root / "small"
    with FileLock(str(root / "small.lock")):
        if not (cwd / "done").exists():
            os.makedirs(cwd, exist_ok=True)
            run_script("sft.py", *TINY_LM, "--max-steps", "300", "--eval-every", "300", "--num-train-examples", "4000",
                       "--eval-size", "32", "--batch-size", "32", "--warmup-steps", "100", cwd=cwd)
            run_script("reward_model.py", "--max-steps", "60", "--eval-every", "60", "--num-train-pairs", "2000",
                       "--eval-size", "64", "--batch-size", "32", "--warmup-steps", "50", cwd=cwd)
            (cwd / "done").touch()
    return {"sft": cwd / "models" / "sft", "reward_model": cwd / "models" / "reward_model"}


def split_rows(data, eval_size=512, seed=1, accepts=(("prompt",), ("text",), ("messages",), ("chosen",))):
    """(train rows, eval rows) a script makes of a .jsonl file with its --eval-size and --seed: load_data, one text
    in every LM script (its random hold-out is tested on its own in test_first_hour.py)."""
    from types import SimpleNamespace

    import sft

    args = SimpleNamespace(dataset_name=str(data), dataset_config=None, dataset_split="train", eval_size=eval_size,
                           seed=seed)
    return sft.load_data(args, None, 0, list(accepts), "")


def module_name(script):
    """The module a script path imports as: "sft.py" -> "sft", "scale/sft.py" -> "scale.sft"."""
    return script[: -len(".py")].replace("/", ".")


def run_in_process(script, *flags, cwd):
    """Run a script's real entry point, `main(tyro.cli(Args))`, in this process (no 4 s of imports per run)."""
    import importlib

    import tyro

    module = importlib.import_module(module_name(script))
    old = os.getcwd()
    os.chdir(cwd)
    try:
        module.main(tyro.cli(module.Args, args=list(flags)))
    finally:
        os.chdir(old)


def one_line_exit(script, *flags, cwd):
    """The message a script's real entry point, run in this process, stops with: it must stop (SystemExit) with one
    line that starts with `error: `, which is what `python <script>` prints, alone, on stderr (test_* files check
    that by subprocess for each script once)."""
    import signal

    with pytest.raises(SystemExit) as stop:
        run_in_process(script, *flags, cwd=cwd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a script or trains a model (CI runs them; `pytest -m 'not slow'` "
                                       "is the fast tier: the math and the copy checks, in seconds)")


def pytest_collection_modifyitems(items):
    """A test that runs a script needs a directory to run it in (or the tiny checkpoints, or monkeypatch
    to chdir): those are the slow tier."""
    for item in items:
        if {"tmp_path", "tmp_path_factory", "tiny_checkpoints", "small_checkpoints", "monkeypatch"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def same_seed_scalars(script, flags, tmp_path):
    """Run `script` twice with the same flags, in two directories; returns the logged scalars of each run
    (without the wall-clock ones: speeds and time fractions) and the bytes of every file each wrote
    under models/. The LM scripts run in this process, one after the other (whatever the first leaves
    behind, the second must not depend on), the RL scripts each in its own."""
    import signal

    runs = []
    for name in ("a", "b"):
        cwd = tmp_path / name
        os.makedirs(cwd)
        if os.path.basename(script) in ("sft.py", "reward_model.py", "dpo.py", "rlhf_ppo.py", "grpo.py", "distill.py", "kto.py"):
            run_in_process(script, *flags, cwd=cwd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        else:
            run_script(script, *flags, cwd=cwd)
        scalars = read_scalars(only_run_dir(cwd))
        saved = {str(p.relative_to(cwd)): p.read_bytes() for p in sorted(cwd.glob("models/**/*.safetensors"))}
        runs.append(({tag: values for tag, values in scalars.items()
                      if not any(word in tag for word in ("SPS", "per_second", "time_fraction"))}, saved))
    return runs


def reference_after_training(script, flags, cwd, monkeypatch):
    """Run `script` in this process and return (its logged scalars, the reference it trained against, as the run
    left it): the first frozen model a scale/ script placed, or the reference a top-level one's load_models returned."""
    import importlib

    module = importlib.import_module(module_name(script))
    placed = []
    if hasattr(module, "place_model"):
        real = module.place_model

        def placing(model, device, args, trained=True):
            out = real(model, device, args, trained)
            if not trained:
                placed.append(out)
            return out

        monkeypatch.setattr(module, "place_model", placing)
    else:
        real = module.load_models

        def loading(*args):
            out = real(*args)
            placed.append(out[3])  # (tokenizer, stop_ids, policy, reference, ...)
            return out

        monkeypatch.setattr(module, "load_models", loading)
    run_in_process(script, *CPU_FLOAT32, *flags, cwd=cwd)
    return read_scalars(only_run_dir(cwd)), placed[0]


def assert_the_reference_stayed(start, trained, reference, scalars):
    """The logged KL is 0 at the evaluation before the first update and not after training (where the run's
    reference is its policy, it stays 0); after training, the reference's logits are the starting checkpoint's and
    the policy's are not: KL[π_θ ‖ π_ref] > 0, computed exactly on the next-token distributions of a few prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert scalars["eval/kl"][0] == (0, 0.0) and scalars["eval/kl"][-1][1] != 0.0  # a policy that is its reference: 0
    tokenizer = AutoTokenizer.from_pretrained(start)
    ids = torch.tensor([tokenizer("sort 83519:", add_special_tokens=False)["input_ids"],
                        tokenizer("sort 20471:", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(start).eval()(input_ids=ids).logits
        if os.path.exists(os.path.join(trained, "adapter_config.json")):  # LoRA: the adapter on the SFT model
            import warnings

            from peft import PeftModel

            with warnings.catch_warnings():  # peft 0.21 on transformers 5
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
                policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(start), trained)
        else:
            policy = AutoModelForCausalLM.from_pretrained(trained)
        policy = policy.eval()(input_ids=ids).logits
        got = reference(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    kl = (policy.log_softmax(-1).exp() * (policy.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert kl.mean() > 1e-6, kl
