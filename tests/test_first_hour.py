"""A new user's first hour with the LM scripts: the thread count on a busy machine, one flag name per meaning, no
silent overwrite of a model directory, and their own data (a malformed or empty file, examples longer than
--max-length, a warmup longer than the run, dpo.py's default reward model with another tokenizer, sampled
completions logged on their data)."""
import json
import shutil

import pytest
import torch
import tyro
from conftest import assert_one_line_error, one_line_exit, only_run_dir, read_scalars, run_in_process, run_script
from lm_models import save_checkpoint
from test_real_models import write_data

import dpo
import grpo
import reward_model
import rlhf_ppo
import sft
from scale import dpo as scale_dpo
from scale import grpo as scale_grpo
from scale import rlhf_ppo as scale_rlhf_ppo
from scale import sft as scale_sft

LM_SCRIPTS = [sft, reward_model, dpo, rlhf_ppo, grpo, scale_sft, scale_dpo, scale_rlhf_ppo, scale_grpo]


# ------------------------------------------------------------------------------------------------
# --threads: one fewer than the cores by default, so that a busy machine does not stall every step
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [sft, scale_sft], ids=lambda m: m.__name__)
def test_the_default_thread_count_leaves_a_core_free(script, monkeypatch):
    """cpu_threads: --threads as given; else OMP_NUM_THREADS where set (torchrun sets 1 per rank); else one fewer
    than the cores this process may use (3 of 4), and 1 on one core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert script.cpu_threads(None) == 3 and script.cpu_threads(2) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert script.cpu_threads(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert script.cpu_threads(None) == 5


@pytest.mark.parametrize("script", ["sft.py", "scale/sft.py"])
def test_threads_reaches_torch_and_zero_is_one_line(script, tmp_path, monkeypatch, capsys):
    """--threads 2 sets torch's thread count before any work; --threads 0 stops with one line. (The default
    warmup of 100 steps in a 1-step run: the warning is the first line.)"""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    run_in_process(script, "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--max-steps", "1", "--eval-size", "0",
                   "--num-train-examples", "64", "--threads", "2", "--output-dir", "out", cwd=tmp_path)
    assert calls == [2]
    assert capsys.readouterr().out.startswith("warning: --warmup-steps 100 ≥ --max-steps 1: the learning rate peaks")
    assert "--threads 0" in one_line_exit(script, "--threads", "0", cwd=tmp_path)


# ------------------------------------------------------------------------------------------------
# One flag name per meaning: --model-name-or-path for the starting model in every LM script (TRL's name)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [dpo, rlhf_ppo, grpo, scale_dpo, scale_rlhf_ppo, scale_grpo], ids=lambda m: m.__name__)
def test_the_starting_model_is_model_name_or_path_and_the_old_name_still_works(script):
    for flag in ("--model-name-or-path", "--sft-model-path"):
        assert tyro.cli(script.Args, args=[flag, "my-sft"]).model_name_or_path == "my-sft"


@pytest.mark.parametrize("script", LM_SCRIPTS, ids=lambda m: m.__name__)
def test_every_lm_script_names_its_model_data_and_output_alike(script):
    fields = set(script.Args.__dataclass_fields__)
    assert {"model_name_or_path", "dataset_name", "output_dir", "threads"} <= fields, fields
    assert "sft_model_path" not in fields


def test_the_old_flag_name_says_so_in_one_line(tmp_path):
    """`grpo.py --sft-model-path DIR`: a note on stdout names the new flag, then the run goes on with DIR (here a
    missing one, which is the one error line)."""
    proc = run_script("grpo.py", "--sft-model-path", "models/none", cwd=tmp_path, check=False)
    assert proc.stdout.startswith("note: --sft-model-path is now --model-name-or-path"), proc.stdout
    assert_one_line_error(proc, "models/none")


# ------------------------------------------------------------------------------------------------
# No silent overwrite: a run whose --output-dir holds a model says so before any work
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [sft, scale_sft], ids=lambda m: m.__name__)
def test_a_model_directory_another_run_wrote_is_named_before_any_work(script, tmp_path, capsys):
    script.note_overwrite(str(tmp_path / "models" / "sft"))
    assert capsys.readouterr().out == ""  # nothing there yet
    (tmp_path / "models" / "sft").mkdir(parents=True)
    (tmp_path / "models" / "sft" / "config.json").write_text("{}")
    (tmp_path / "models" / "sft" / "training_args.json").write_text(json.dumps({"exp_name": "sft", "max_steps": 20}))
    script.note_overwrite(str(tmp_path / "models" / "sft"))
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith(f"note: --output-dir {tmp_path}/models/sft holds a model saved ")
    assert "by a run of sft --max-steps 20; this run replaces it when it ends" in line


def test_sft_saving_over_a_model_says_so_first(tmp_path, capsys):
    flags = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--max-steps", "1", "--warmup-steps", "0",
             "--eval-size", "0", "--num-train-examples", "64", "--output-dir", "out"]
    run_in_process("sft.py", *flags, cwd=tmp_path)
    assert "note: --output-dir" not in capsys.readouterr().out
    run_in_process("sft.py", *flags, cwd=tmp_path)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("note: --output-dir out holds a model saved") and "by a run of sft --max-steps 1" in first


# ------------------------------------------------------------------------------------------------
# Own data on the first try
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["sft.py", "dpo.py", "scale/grpo.py"])
@pytest.mark.parametrize("content, words", [
    ("", "data.jsonl has no rows"),
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "a" "completion": "b"}\n', "data.jsonl, line 2: not JSON"),
    ('{"prompt": "a", "completion": "b"}\n\n["a", "b"]\n', "data.jsonl, line 3: a JSON list, not an object"),
])
def test_an_empty_or_malformed_jsonl_is_one_line_naming_the_file_and_line(script, content, words, tmp_path):
    (tmp_path / "data.jsonl").write_text(content)
    reward = ["--reward-fn", "exact_match"] if "grpo" in script else []
    message = one_line_exit(script, "--dataset-name", "data.jsonl", *reward, cwd=tmp_path)
    assert words in message, message


def test_a_malformed_json_file_names_its_line(tmp_path):
    (tmp_path / "data.json").write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "a",}\n]\n')
    assert "data.json, line 3: not JSON" in one_line_exit("sft.py", "--dataset-name", "data.json",
                                                          cwd=tmp_path)


def test_examples_longer_than_max_length_name_their_lengths_and_the_flag(tmp_path):
    base = save_checkpoint(str(tmp_path / "base"), "gpt2", "eos_no_pad", "float32")
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    message = one_line_exit("sft.py", "--model-name-or-path", base, "--dataset-name", data, "--max-length", "4",
                            cwd=tmp_path)
    assert message.startswith("error: no training example fits --max-length 4: they have ") and message.endswith(
        " tokens; raise --max-length (TRL's default: 1024)"), message
    data = write_data(tmp_path / "p.jsonl", "explicit")
    message = one_line_exit("dpo.py", "--model-name-or-path", base, "--dataset-name", data, "--max-length", "4",
                            "--reward-model-path", "None", cwd=tmp_path)
    assert message.startswith("error: no training pair fits --max-length 4: they have ") and "raise --max-length" in message


@pytest.mark.parametrize("script, decay", [(sft, "cosine"), (reward_model, "linear"), (scale_dpo, "linear")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_a_warmup_as_long_as_the_run_is_one_warning(script, decay, capsys):
    script.check_warmup(100, 20, decay)
    line = capsys.readouterr().out
    peak = {"cosine": "6%", "linear": "20%"}[decay]  # get_lr's largest value over 20 steps of a 100-step warmup
    assert line == f"warning: --warmup-steps 100 ≥ --max-steps 20: the learning rate peaks at {peak} of --lr; " \
                   "lower --warmup-steps\n", line
    script.check_warmup(10, 20, decay)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("script", ["dpo.py", "scale/dpo.py"])
def test_dpo_skips_its_default_reward_model_when_the_tokenizers_differ(script, tiny_checkpoints, tmp_path, capsys):
    """models/reward_model, the default, with one token more than the policy's tokenizer: one note, then DPO
    trains without eval/score. Given explicitly, the same model is an error (test_rewards.py)."""
    from transformers import AutoTokenizer

    models = tiny_checkpoints["cwd"] / "models"
    shutil.copytree(models / "reward_model", tmp_path / "models" / "reward_model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "models" / "reward_model")
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(tmp_path / "models" / "reward_model")
    run_in_process(script, "--model-name-or-path", str(models / "sft"), "--max-steps", "1", "--num-train-pairs", "64",
                   "--eval-size", "8", "--output-dir", "out", cwd=tmp_path)
    out = capsys.readouterr().out
    assert "note: models/reward_model (the default --reward-model-path) has another tokenizer than" in out, out
    assert "eval/score" not in read_scalars(only_run_dir(tmp_path)) and (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("script", ["sft.py", "scale/sft.py"])
def test_sft_logs_sampled_completions_on_own_data(script, tmp_path):
    """On a dataset (no gold answer to score), evaluation still shows completions sampled from held-out prompts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base = save_checkpoint(str(tmp_path / "base"), "gpt2", "eos_no_pad", "float32")
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    run_in_process(script, "--model-name-or-path", base, "--dataset-name", data, "--max-steps", "2", "--batch-size", "4",
                   "--eval-every", "2", "--eval-size", "8", "--output-dir", "out", cwd=tmp_path)
    acc = EventAccumulator(only_run_dir(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    samples = acc.Tensors("eval/samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])["prompt"]
    assert samples.count("\n") == 3 and samples.startswith(f"    {first!r} "), samples  # the 4 held-out rows
