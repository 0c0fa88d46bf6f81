"""Long runs: a run of 2N steps and a run resumed from its checkpoint at step N give bitwise the same weights and
the same logged scalars after step N; SIGTERM leaves a checkpoint and exit code 0; a crash while writing one
leaves the previous one loadable; bad --resume input is one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY_LM, assert_one_line_error, only_run_dir, read_scalars, run_in_process, run_script
from test_distributed import torchrun

CLOCK_TAGS = ("per_second", "time_fraction")  # wall-clock speeds: never the same twice


def in_process(script, *flags, cwd):
    """run_in_process (no 4 s of imports per run), then SIGTERM's handler back to the default (main installs its own)."""
    try:
        run_in_process(script, *flags, cwd=cwd)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def one_line_exit(script, *flags, cwd):
    """The message a run in this process stops with: it must stop (SystemExit) with one line, before any traceback."""
    with pytest.raises(SystemExit) as stop:
        in_process(script, *flags, cwd=cwd)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def scalars_and_weights(cwd):
    """The logged scalars (without wall-clock speeds) and the bytes of every weight file under models/."""
    scalars = {tag: values for tag, values in read_scalars(only_run_dir(cwd)).items()
               if not any(word in tag for word in CLOCK_TAGS)}
    weights = {str(p.relative_to(cwd)): p.read_bytes() for p in sorted(cwd.glob("models/**/*.safetensors"))}
    return scalars, weights


def check_exact_resume(script, flags, n, tmp_path, run=in_process):
    """Two runs of the same flags: `saver`, 2n steps straight through with --save-every n; `resumed`, in a fresh
    directory that holds only saver's checkpoint at step n, with --resume. Resumed must end with saver's weights,
    byte for byte, and log saver's scalars after step n, and nothing at or before it. (That writing a checkpoint
    changes nothing in the run that writes it: test_writing_checkpoints_changes_nothing.)"""
    dirs = {name: tmp_path / name for name in ("saver", "resumed")}
    for d in dirs.values():
        os.makedirs(d)
    run(script, *flags, "--save-every", str(n), cwd=dirs["saver"])
    run_dir = only_run_dir(dirs["saver"])
    copy = dirs["resumed"] / "runs" / os.path.basename(run_dir)
    shutil.copytree(os.path.join(run_dir, f"checkpoint-{n}"), copy / f"checkpoint-{n}")
    run(script, *flags, "--resume", str(copy), cwd=dirs["resumed"])
    (full, full_weights), (resumed, resumed_weights) = scalars_and_weights(dirs["saver"]), scalars_and_weights(dirs["resumed"])
    assert full_weights == resumed_weights and len(full_weights) == 1
    after = {tag: [(s, v) for s, v in values if s > n] for tag, values in full.items()}
    assert {tag: values for tag, values in after.items() if values} == resumed
    assert sum(len(values) for values in resumed.values()) >= 5


def lm_flags(script, models):
    """(flags, N) of a short run of each LM script from the tiny checkpoints: 2N steps or iterations."""
    sft, rm = str(models / "sft"), str(models / "reward_model")
    if script == "scale/sft.py":
        return [*TINY_LM, "--max-steps", "20", "--eval-every", "5", "--num-train-examples", "300", "--eval-size", "8",
                "--batch-size", "8", "--warmup-steps", "3", "--output-dir", "models/m"], 10
    if script == "scale/reward_model.py":
        return ["--model-name-or-path", sft, "--max-steps", "20", "--eval-every", "5", "--num-train-pairs", "200",
                "--eval-size", "8", "--batch-size", "8", "--output-dir", "models/m"], 10
    if script == "scale/dpo.py":
        return ["--model-name-or-path", sft, "--reward-model-path", rm, "--max-steps", "20", "--batch-size", "4",
                "--num-train-pairs", "100", "--eval-size", "8", "--eval-every", "5", "--warmup-steps", "2",
                "--output-dir", "models/m"], 10
    if script == "scale/rlhf_ppo.py":  # the adaptive KL controller on: its coefficient is part of what is restored
        return ["--model-name-or-path", sft, "--reward-model-path", rm, "--num-iterations", "4", "--batch-size", "16",
                "--mini-batch-size", "8", "--ppo-epochs", "2", "--eval-size", "8", "--eval-every", "2",
                "--kl-target", "0.001", "--kl-horizon", "100", "--output-dir", "models/m"], 2
    # grpo: adaptive entropy control on (a target above any entropy, ln 384 = 5.95): its coefficient is restored
    return ["--model-name-or-path", sft, "--num-iterations", "4", "--batch-size", "16", "--num-generations", "4",
            "--mini-batch-size", "8", "--eval-size", "8", "--eval-every", "2", "--use-adaptive-entropy",
            "--entropy-target", "10", "--entropy-coef-delta", "0.05", "--output-dir", "models/m"], 2


@pytest.mark.parametrize("script", ["scale/sft.py", "scale/reward_model.py", "scale/dpo.py", "scale/rlhf_ppo.py", "scale/grpo.py"])
def test_exact_resume_one_process(tiny_checkpoints, tmp_path, script):
    flags, n = lm_flags(script, tiny_checkpoints["cwd"] / "models")
    check_exact_resume(script, flags, n, tmp_path)


@pytest.mark.parametrize("script,fsdp", [("scale/sft.py", False), ("scale/rlhf_ppo.py", True)], ids=["sft-ddp", "rlhf_ppo-fsdp"])
def test_exact_resume_two_ranks(tiny_checkpoints, tmp_path, script, fsdp):
    """torchrun, 2 gloo ranks: under --fsdp each rank saves and loads its own shards (torch.distributed.checkpoint).
    Two cells of script × mode (sft with --fsdp and rlhf_ppo with DDP also hold, and are not run in CI, for its
    20 minutes)."""
    flags, n = lm_flags(script, tiny_checkpoints["cwd"] / "models")
    check_exact_resume(script, flags + ["--fsdp"] * fsdp, n, tmp_path, run=torchrun)


BY_RANK = """import os, re

def by_rank(prompts, completions, **columns):
    # rank 0: the parity of each completion's length; rank 1 the same, but 1.0 for every completion of a prompt
    # whose digits add up to an even number: groups of equal rewards, which --dynamic-sampling replaces
    if os.environ["RANK"] == "1":
        return [1.0 if sum(map(int, re.findall(r"[0-9]", p))) % 2 == 0 else float(len(c) % 2)
                for p, c in zip(prompts, completions)]
    return [float(len(c) % 2) for c in completions]
"""


def test_dynamic_sampling_two_ranks_agree_and_resume_exactly(small_checkpoints, tmp_path):
    """grpo.py --dynamic-sampling under torchrun, 2 gloo ranks whose groups of equal rewards differ in number: every
    rank samples as many extra batches of prompts as the rank that needs most (else a collective would hang), and
    the extra prompts drawn are part of the state a checkpoint restores (exact resume)."""
    (tmp_path / "by_rank.py").write_text(BY_RANK)
    flags, n = lm_flags("scale/grpo.py", small_checkpoints["sft"].parent)  # an SFT model whose completions stop
    flags += ["--reward-fn", str(tmp_path / "by_rank.py") + ":by_rank", "--dynamic-sampling"]
    check_exact_resume("scale/grpo.py", flags, n, tmp_path, run=torchrun)
    logs = read_scalars(only_run_dir(tmp_path / "saver"))
    sampled, zero_std = ([v for _, v in logs[tag]] for tag in ("objective/prompts_sampled", "objective/zero_std_fraction"))
    assert any(4 < k < 16 for k in sampled), sampled  # extra batches, without reaching --max-sampling-rounds 4
    # with fewer than --max-sampling-rounds batches, no group of equal rewards is left in the batch
    assert [z for k, z in zip(sampled, zero_std) if k < 16] == [0.0] * sum(k < 16 for k in sampled), (sampled, zero_std)


def test_writing_checkpoints_changes_nothing(tiny_checkpoints, tmp_path):
    """sft.py with a checkpoint every 3 steps logs and saves what it does without any."""
    flags, _ = lm_flags("scale/sft.py", tiny_checkpoints["cwd"] / "models")
    for name, extra in (("plain", []), ("saving", ["--save-every", "3"])):
        os.makedirs(tmp_path / name)
        in_process("scale/sft.py", *flags, *extra, cwd=tmp_path / name)
    assert scalars_and_weights(tmp_path / "plain") == scalars_and_weights(tmp_path / "saving")


def test_the_checkpoint_holds_what_resuming_needs(tiny_checkpoints, tmp_path):
    """rlhf_ppo: the actor and the critic's weights and head (not the frozen reference and reward model), AdamW's
    moments, each rank's random streams, the prompt sampler and the adaptive KL coefficient; the last
    --keep-checkpoints are kept."""
    import torch

    flags, _ = lm_flags("scale/rlhf_ppo.py", tiny_checkpoints["cwd"] / "models")
    in_process("scale/rlhf_ppo.py", *flags, "--save-every", "1", "--keep-checkpoints", "2", cwd=tmp_path)
    run_dir = only_run_dir(tmp_path)
    assert sorted(name for name in os.listdir(run_dir) if name.startswith("checkpoint")) == ["checkpoint-3", "checkpoint-4"]
    path = os.path.join(run_dir, "checkpoint-4")
    meta = json.load(open(os.path.join(path, "checkpoint.json")))
    assert (meta["script"], meta["step"], meta["world_size"], meta["args"]["kl_target"]) == ("rlhf_ppo.py", 4, 1, 0.001)  # its file's name
    rank0 = torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    assert set(rank0["random"]) == {"python", "numpy", "torch", "cuda"}
    assert rank0["loop"]["step"] == 4 and rank0["loop"]["kl_coef"] != 0.05 and len(rank0["loop"]["rng"][1]) == 625
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    assert any(k.startswith("model.0.") for k in keys) and any(k.startswith("model.1.classifier.score.") for k in keys)
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in keys)


@pytest.mark.parametrize("script", ["scale/sft.py", "scale/reward_model.py", "scale/dpo.py", "scale/rlhf_ppo.py",
                                    "scale/grpo.py"])
def test_the_last_keep_checkpoints_are_kept(script, tmp_path):
    """Each script's save_checkpoint, five checkpoints in a row with --keep-checkpoints 3 (not the default 2):
    the last three are left, each complete."""
    import importlib

    import torch
    import tyro

    module = importlib.import_module(script[: -len(".py")].replace("/", "."))
    args = tyro.cli(module.Args, args=["--keep-checkpoints", "3"])
    trained = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(trained.parameters())
    for step in range(1, 6):
        module.save_checkpoint(str(tmp_path), step, trained, optimizer, args, {})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert all(os.path.exists(tmp_path / name / "checkpoint.json") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("script,env", [("ppo_clip", "Clock-v0"), ("ppo_kl", "Clock-v0"), ("ppo_continuous", "ClockBox-v0")])
def test_an_rl_run_keeps_the_last_keep_checkpoints(script, env, tmp_path, monkeypatch):
    """A PPO script at --save-every 1 --keep-checkpoints 3 (not the default 2) for five iterations: checkpoints 3, 4
    and 5 are left."""
    import importlib

    import rl_envs  # noqa: F401  registers the tiny envs

    module = importlib.import_module(script)
    monkeypatch.chdir(tmp_path)
    module.main(module.Args(env_id=env, cuda=False, total_timesteps=200, num_envs=2, num_steps=20, num_minibatches=2,
                            eval_episodes=0, save_every=1, keep_checkpoints=3))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert sorted(name for name in os.listdir(only_run_dir(tmp_path)) if name.startswith("checkpoint")) == [
        "checkpoint-3.pt", "checkpoint-4.pt", "checkpoint-5.pt"]


def test_sigterm_saves_a_checkpoint_and_exits_0_then_resume_finishes(tmp_path):
    """SIGTERM in the middle of training: exit code 0, a checkpoint at the step it stopped after, no final model,
    and the command to resume, which finishes the run."""
    flags = [*TINY_LM, "--max-steps", "300", "--num-train-examples", "300", "--eval-size", "8", "--batch-size", "8",
             "--eval-every", "1000", "--output-dir", "models/m"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scale/sft.py"), *flags], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # wait until it trains: the run directory appears right before the loop
        if (tmp_path / "runs").exists() and os.listdir(tmp_path / "runs"):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    run_dir = only_run_dir(tmp_path)
    checkpoints = [name for name in os.listdir(run_dir) if name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and 0 < int(checkpoints[0].split("-")[1]) < 300, checkpoints
    assert not (tmp_path / "models" / "m").exists()  # the run is not over: no final model
    command = out.split("resume with:\n")[1].strip().split()
    assert command[:2] == ["python", os.path.join(ROOT, "scale/sft.py")]
    assert command[2:] == [*flags, "--resume", os.path.join("runs", os.path.basename(run_dir))]
    done = run_script("scale/sft.py", *command[2:], cwd=tmp_path)
    assert f"resumed from runs/{os.path.basename(run_dir)}/{checkpoints[0]}" in done.stdout
    assert (tmp_path / "models" / "m" / "model.safetensors").exists()
    assert max(step for step, _ in read_scalars(run_dir)["losses/loss"]) == 300


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tiny_checkpoints, tmp_path, monkeypatch):
    """A write that fails half-way (here: the disk "fills" while the random streams are saved at step 4) stops the
    run with one line; checkpoint-2 is untouched and a run resumes from it exactly."""
    import torch

    from scale import sft

    flags = [*TINY_LM, "--max-steps", "6", "--eval-every", "3", "--num-train-examples", "300", "--eval-size", "8",
             "--batch-size", "8", "--output-dir", "models/m", "--save-every", "2"]
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **k):
        calls.append(f)
        if "checkpoint-4" in str(f):
            open(f, "wb").write(b"half")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.chdir(tmp_path)
    import tyro

    with pytest.raises(SystemExit) as stop:
        sft.main(tyro.cli(sft.Args, args=flags))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert "No space left on device" in str(stop.value.code) and "checkpoint-4" in str(stop.value.code)
    run_dir = only_run_dir(tmp_path)
    assert sorted(os.listdir(run_dir)) == ["checkpoint-2", "checkpoint-4.tmp", *[n for n in os.listdir(run_dir) if n.startswith("events")]]
    monkeypatch.setattr(torch, "save", real_save)
    resumed = run_script("scale/sft.py", *flags, "--resume", run_dir, cwd=tmp_path)
    assert "resumed from" in resumed.stdout and "checkpoint-2 (step 2)" in resumed.stdout
    assert not os.path.exists(os.path.join(run_dir, "checkpoint-4.tmp")) and os.path.isdir(os.path.join(run_dir, "checkpoint-6"))


def test_bad_resume_input_is_one_line_and_writes_nothing(tiny_checkpoints, tmp_path, monkeypatch):
    flags, _ = lm_flags("scale/sft.py", tiny_checkpoints["cwd"] / "models")
    in_process("scale/sft.py", *flags, "--save-every", "10", cwd=tmp_path)
    run_dir = only_run_dir(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    cases = [
        ("scale/sft.py", [*flags, "--resume", "runs/nothing"], ["no checkpoint there"]),
        ("scale/sft.py", [*flags, "--resume", str(tmp_path / "models")], ["no checkpoint there"]),
        ("scale/reward_model.py", ["--model-name-or-path", str(tiny_checkpoints["sft"]), "--resume", run_dir],
         ["checkpoint of sft.py", "reward_model.py"]),
        ("scale/sft.py", [*flags[:-2], "--batch-size", "16", "--output-dir", "models/m", "--resume", run_dir],
         ["--batch-size is 16 here but 8"]),
        ("scale/sft.py", [*flags, "--n-embd", "64", "--resume", run_dir], ["--n-embd is 64 here but 32"]),
    ]
    for script, case, words in cases:
        message = one_line_exit(script, *case, cwd=tmp_path)
        assert all(word in message for word in words), message
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: checked before the process group is joined
    assert "saved by 1 rank(s) and this run has 2" in one_line_exit("scale/sft.py", *flags, "--resume", run_dir, cwd=tmp_path)
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written, not even a run directory


# ------------------------------------------------------------------------------------------------
# The RL scripts: everything but the environments' state is restored (the episodes in progress start over)
# ------------------------------------------------------------------------------------------------
RL_RUNS = {
    "ppo_clip": ["--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "64", "--eval-episodes", "0"],
    "ppo_kl": ["--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "64", "--eval-episodes", "0",
               "--kl-target", "1e-5"],  # β doubles at every update (the KL per update is 1e-4 or more)
    "ppo_continuous": ["--env-id", "Pendulum-v1", "--total-timesteps", "2048", "--num-steps", "256", "--num-minibatches",
                       "4", "--update-epochs", "2", "--eval-episodes", "0"],
}


def training_state(module, frame_locals):
    """Everything a resumed RL run must have as the saved one had it, read from main's local variables: the agent's
    weights, Adam's state and learning rate, the running statistics, β, the global step, and the random streams."""
    import copy

    state = {"agent": copy.deepcopy(frame_locals["agent"].state_dict()),
             "optimizer": copy.deepcopy(frame_locals["optimizer"].state_dict()),
             "global_step": frame_locals["global_step"], "random": module.random_streams()}
    for name in ("obs_rms", "return_rms"):
        if name in frame_locals:
            rms = frame_locals[name]
            state[name] = (rms.mean.copy(), rms.var.copy(), rms.count)
    if "beta" in frame_locals:
        state["beta"] = frame_locals["beta"]
    return state


def same(a, b):
    """Bitwise equality of nested dicts, lists and tuples of tensors, arrays and numbers."""
    import numpy as np
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype
    return a == b


@pytest.mark.parametrize("script", list(RL_RUNS))
def test_rl_resume_restores_all_but_the_environments(tmp_path, monkeypatch, script):
    """A run saves at iteration 4 (of 8); a run resumed from that checkpoint starts its loop with the saved run's
    weights, Adam state and learning rate, statistics, β, global step and random streams, bitwise, and logs from
    the next iteration's global step to the end."""
    import importlib
    import sys as _sys

    import tyro

    module = importlib.import_module(script)
    flags = RL_RUNS[script]
    at_save, at_resume = {}, {}
    real_save, real_preemption = module.save_resume_point, module.Preemption

    def spy_save(run_dir, iteration, *args, **kwargs):
        at_save[iteration] = training_state(module, _sys._getframe(1).f_locals)
        return real_save(run_dir, iteration, *args, **kwargs)

    class SpyPreemption(real_preemption):  # made right before the loop: the resumed state is complete then
        def __init__(self):
            super().__init__()
            at_resume.update(training_state(module, _sys._getframe(1).f_locals))

    monkeypatch.setattr(module, "save_resume_point", spy_save)
    monkeypatch.chdir(tmp_path)
    try:
        module.main(tyro.cli(module.Args, args=[*flags, "--save-every", "4"]))
        run_dir = only_run_dir(tmp_path)
        full = read_scalars(run_dir)
        resumed_dir = tmp_path / "resumed" / "runs" / os.path.basename(run_dir)
        os.makedirs(resumed_dir)
        shutil.copy(os.path.join(run_dir, "checkpoint-4.pt"), resumed_dir)
        monkeypatch.setattr(module, "Preemption", SpyPreemption)
        monkeypatch.chdir(tmp_path / "resumed")
        module.main(tyro.cli(module.Args, args=[*flags, "--resume", str(resumed_dir)]))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert set(at_save) == {4, 8} and at_resume["global_step"] == 4 * 256
    assert same(at_save[4], at_resume)
    assert {"return_rms", "obs_rms"} <= set(at_resume) if script == "ppo_continuous" else True
    assert script != "ppo_kl" or at_resume["beta"] != 1.0  # β had moved: the saved one, not --kl-beta
    resumed = read_scalars(str(resumed_dir))
    steps = sorted({s for values in resumed.values() for s, _ in values})
    assert 4 * 256 < steps[0] <= 5 * 256 and steps[-1] == 2048 == max(s for s, _ in full["charts/learning_rate"])
    assert resumed["charts/learning_rate"] == [(s, v) for s, v in full["charts/learning_rate"] if s > 4 * 256]


def test_rl_bad_resume_input_is_one_line(tmp_path):
    base = RL_RUNS["ppo_clip"]
    made = tmp_path / "made"
    os.makedirs(made)
    in_process("ppo_clip.py", *base, "--save-every", "4", "--save-model", cwd=made)
    run_dir = only_run_dir(made)
    ckpt, model = os.path.join(run_dir, "checkpoint-8.pt"), os.path.join(run_dir, "ppo_clip.pt")
    os.makedirs(tmp_path / "runs")
    cases = [
        ("ppo_clip.py", ["--resume", "runs/none"], ["--resume runs/none", "FileNotFoundError"]),
        ("ppo_clip.py", ["--resume", "runs"], ["no checkpoint-<iteration>.pt there"]),
        ("ppo_clip.py", ["--resume", ckpt, "--num-steps", "32"], ["--num-steps is 32 here but 64"]),
        ("ppo_clip.py", ["--resume", ckpt, "--load-model", ckpt], ["pass one"]),
        ("ppo_clip.py", ["--resume", model], ["KeyError"]),  # a --save-model file: no resume state
        ("ppo_clip.py", ["--save-every", "-1"], ["--save-every must be ≥ 0"]),
        ("ppo_kl.py", ["--resume", ckpt], ["checkpoint of ppo_clip.py"]),
    ]
    for script, flags, words in cases:
        message = one_line_exit(script, *base, *flags, cwd=tmp_path)
        assert all(word in message for word in words), message
    assert os.listdir(tmp_path / "runs") == []
    # and once through the real entry point: the same line on stderr, no traceback
    assert_one_line_error(run_script("ppo_clip.py", *base, "--resume", "runs", cwd=tmp_path, check=False),
                          "no checkpoint-<iteration>.pt there")


def wait_for_training(proc, cwd, seconds=60):
    """Wait until a run started in `cwd` trains (its TensorBoard log appears right before the loop; the LM scripts
    make the run directory before loading the models), then a little."""
    for _ in range(seconds * 10):
        if list(cwd.glob("runs/*/events.out.tfevents.*")):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.5)


def test_an_rl_run_stopped_by_sigterm_saves_and_its_resume_finishes(tmp_path):
    """SIGTERM in the middle of a PPO run: exit code 0, one checkpoint-<iteration>.pt, no final agent, the command
    that resumes it, which finishes the run."""
    flags = ["--total-timesteps", "25600", "--num-envs", "2", "--num-steps", "128", "--eval-episodes", "0",
             "--save-model"]  # 100 iterations; SIGTERM lands in the first few
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "ppo_clip.py"), *flags], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_training(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    run_dir = only_run_dir(tmp_path)
    checkpoints = [name for name in os.listdir(run_dir) if name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and 0 < int(checkpoints[0][len("checkpoint-") : -len(".pt")]) < 100, checkpoints
    assert not [name for name in os.listdir(run_dir) if name == "ppo_clip.pt"]  # not over: no final agent
    command = out.split("resume with:\n")[1].strip().split()
    assert command[2:] == [*flags, "--resume", os.path.join("runs", os.path.basename(run_dir))]
    run_script("ppo_clip.py", *command[2:], cwd=tmp_path)
    assert os.path.exists(os.path.join(run_dir, "ppo_clip.pt"))
    assert max(step for step, _ in read_scalars(run_dir)["charts/SPS"]) == 25600


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Under torchrun a scheduler may signal one process only: rank 1 alone gets SIGTERM, and both ranks still stop
    after the same step, write one checkpoint together and exit 0."""
    flags = [*TINY_LM, "--max-steps", "2000", "--num-train-examples", "300", "--eval-size", "8", "--batch-size", "8",
             "--eval-every", "10000", "--output-dir", "models/m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             os.path.join(ROOT, "scale/sft.py"), *flags], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_training(proc, tmp_path, seconds=120)
    ranks = {}
    for child in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{child}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        ranks[int(environ[b"RANK"])] = int(child)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    run_dir = only_run_dir(tmp_path)
    checkpoints = [name for name in os.listdir(run_dir) if name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and 0 < int(checkpoints[0].split("-")[1]) < 2000, checkpoints
    step = json.load(open(os.path.join(run_dir, checkpoints[0], "checkpoint.json")))["step"]
    saved = sorted(name for name in os.listdir(os.path.join(run_dir, checkpoints[0])) if name.startswith("rank"))
    assert saved == ["rank0.pt", "rank1.pt"] and f"stopped after step {step}" in out
    assert not (tmp_path / "models" / "m").exists()
