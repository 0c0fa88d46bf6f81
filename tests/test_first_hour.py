"""A new user's first hour with the LM scripts: the thread count on a busy machine, one flag name per meaning, no
silent overwrite of a model directory, and their own data (a malformed or empty file, examples longer than
--max-length, a warmup longer than the run, dpo.py's default reward model with another tokenizer, sampled
completions logged on their data)."""
import json
import os
import shutil

import pytest
import torch
import tyro
from conftest import (
    TINY_LM,
    assert_one_line_error,
    one_line_exit,
    only_run_dir,
    read_scalars,
    run_in_process,
    run_script,
    split_rows,
)
from lm_models import save_checkpoint
from test_real_models import model_flags, write_data

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


# A bad row: (its format, the row, the words of the one line about it). Each format's accepted columns are those
# of the scripts that take it (sft.py: text, prompt/completion, messages; reward_model.py and dpo.py: preference,
# explicit or implicit; rlhf_ppo.py, grpo.py, distill.py: prompts), text or conversational.
USER = [{"role": "user", "content": "sort 3 1:"}]
BAD_ROWS = [
    ("text", {"text": None}, "no `text` (missing or null)"),
    ("text", {"text": ["sort", "1 3"]}, "`text` is a list, not text"),
    ("text", {"text": USER}, "`text` is a list, not text"),
    ("prompt_completion", {"prompt": "sort 3 1:"}, "no `completion` (missing or null)"),
    ("prompt_completion", {"prompt": "sort 3 1:", "completion": ""}, "`completion` is empty"),
    ("prompt_completion", {"prompt": 31, "completion": " 1 3"}, "`prompt` is a number (31), not text or a list of messages"),
    ("conversational_prompt_completion", {"prompt": USER, "completion": " 1 3"},
     "`prompt` is a conversation but `completion` is text; a row is all one kind"),
    ("conversational_prompt_completion", {"prompt": USER, "completion": []}, "`completion` is empty"),
    ("messages", {"messages": [{"role": "bot", "content": "1 3"}]}, "`messages`, message 1: 'bot' is not a role (system, "
     "developer, user, assistant, tool)"),
    ("messages", {"messages": "sort 3 1: 1 3"}, "`messages` is text, not a list of messages"),
    ("messages", {"messages": [*USER, {"role": "assistant", "content": 13}]}, "`messages`, message 2: its `content` is "
     "not text"),
    ("explicit", {"prompt": "sort 3 1:", "chosen": " 1 3"}, "no `rejected` (missing or null)"),
    ("explicit", {"prompt": None, "chosen": " 1 3", "rejected": " 3 1"}, "no `prompt` (missing or null)"),
    ("implicit", {"chosen": "sort 3 1: 1 3", "rejected": 3.1}, "`rejected` is a number (3.1), not text or a list"),
    ("conversational_explicit", {"prompt": USER, "chosen": ["1 3"], "rejected": [{"role": "assistant", "content": "3 1"}]},
     "`chosen`, message 1 is a str, not a {role, content} object"),
    ("conversational_implicit", {"chosen": [*USER, {"role": "assistant", "content": "1 3"}], "rejected": USER[0]},
     "`rejected` is an object, not text or a list of messages"),
    ("text_prompts", {"prompt": ""}, "`prompt` is empty"),
    ("text_prompts", {"prompt": None}, "no `prompt` (missing or null)"),
    ("conversational_prompts", {"prompt": [{"role": "User", "content": "sort 3 1:"}]}, "`prompt`, message 1: 'User' is "
     "not a role"),
]
ACCEPTS = {"text": "sft", "prompt_completion": "sft", "messages": "sft", "conversational_prompt_completion": "sft",
           "explicit": "preference", "implicit": "preference", "conversational_explicit": "preference",
           "conversational_implicit": "preference", "text_prompts": "prompts", "conversational_prompts": "prompts"}
COLUMNS = {"sft": [("prompt", "completion"), ("text",), ("messages",)],
           "preference": [("prompt", "chosen", "rejected"), ("chosen", "rejected")], "prompts": [("prompt",)]}


def write_with_bad_row(path, fmt, bad, line=8):
    """A .jsonl file of one format whose `line`th line is the bad row."""
    rows = [json.loads(text) for text in open(write_data(path, fmt)).read().splitlines()]
    rows[line - 1] = bad
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


@pytest.mark.parametrize("fmt, bad, words", BAD_ROWS, ids=[f"{fmt}:{words[:30]}" for fmt, _, words in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_the_file_line_and_column(fmt, bad, words, tmp_path):
    """load_data (one text in every LM script) checks every row before any work: a field missing or null, empty,
    of the wrong type (a list where text belongs, a number), text beside a conversation, or a message with a bad
    role or content stops with one line naming the file, the row's line and the column."""
    from types import SimpleNamespace

    path = write_with_bad_row(tmp_path / "d.jsonl", fmt, bad)
    args = SimpleNamespace(dataset_name=str(path), dataset_config=None, dataset_split="train", eval_size=4, seed=1)
    with pytest.raises(SystemExit) as stop:
        sft.load_data(args, None, 0, COLUMNS[ACCEPTS[fmt]], "accepts what it accepts")
    assert str(stop.value.code).startswith(f"error: {path}, line 8: {words}"), stop.value.code
    assert str(stop.value.code).endswith(" (sft.py accepts what it accepts)")
    # the same file with a good row there passes, all 48 rows read (every row is checked before 4 are held out)
    args.dataset_name = write_data(tmp_path / "good.jsonl", fmt)
    train, evals = sft.load_data(args, None, 0, COLUMNS[ACCEPTS[fmt]], "")
    assert len(train) == 44 and len(evals) == 4


def test_a_bad_row_of_a_json_file_or_a_test_split_is_named_by_its_row(tmp_path):
    """A .json file's rows have no lines of their own: its row number; a split of a dataset directory (or the hub):
    the dataset, the split and the row, in the test split too."""
    from types import SimpleNamespace

    import datasets

    rows = [{"prompt": f"sort {i} 1:"} for i in range(20)]
    (tmp_path / "d.json").write_text(json.dumps(rows[:4] + [{"prompt": 5}] + rows[5:]))
    args = SimpleNamespace(dataset_name=str(tmp_path / "d.json"), dataset_config=None, dataset_split="train",
                           eval_size=4, seed=1)
    assert one_line_load(args) == (f"error: {tmp_path}/d.json, row 5: `prompt` is a number (5), not text or a list of "
                                   "messages (sft.py needs a `prompt` column)")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(
        rows[:2] + [{"prompt": ""}] + rows[3:])}).save_to_disk(str(tmp_path / "splits"))
    args.dataset_name = str(tmp_path / "splits")
    assert one_line_load(args).startswith(f"error: dataset '{tmp_path}/splits', split 'test', row 3: `prompt` is empty")


def one_line_load(args):
    with pytest.raises(SystemExit) as stop:
        sft.load_data(args, None, 0, [("prompt",)], "needs a `prompt` column")
    return str(stop.value.code)


# (script, the formats it takes): each script stops on every bad row of each, before a model is loaded or anything
# is written
SCRIPT_FORMATS = [(f"{tier}{script}.py", formats) for tier in ("", "scale/") for script, formats in [
    ("sft", ["text", "prompt_completion", "messages", "conversational_prompt_completion"]),
    ("reward_model", ["explicit", "implicit", "conversational_explicit", "conversational_implicit"]),
    ("dpo", ["explicit", "implicit", "conversational_explicit", "conversational_implicit"]),
    ("rlhf_ppo", ["text_prompts", "conversational_prompts"]),
    ("grpo", ["text_prompts", "conversational_prompts"])]] + [("distill.py", ["text_prompts", "conversational_prompts"])]


@pytest.mark.parametrize("script, formats", SCRIPT_FORMATS, ids=[s for s, _ in SCRIPT_FORMATS])
def test_every_lm_script_names_a_bad_row_of_each_format_it_takes(script, formats, tiny_checkpoints, tmp_path):
    flags = [] if script == "distill.py" else model_flags(script, tiny_checkpoints)
    reward = ["--reward-fn", "exact_match"] if "grpo" in script else []
    for n, (fmt, bad, words) in enumerate(row for row in BAD_ROWS if row[0] in formats):
        write_with_bad_row(tmp_path / f"{n}.jsonl", fmt, bad)
        message = one_line_exit(script, *flags, *reward, "--dataset-name", f"{n}.jsonl", cwd=tmp_path)
        assert message.startswith(f"error: {n}.jsonl, line 8: {words}"), message
    assert all(name.endswith(".jsonl") for name in os.listdir(tmp_path))  # nothing written


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


@pytest.mark.parametrize("script", ["sft", "scale.sft"])
def test_own_data_samples_show_the_data_s_completion_beside(script):
    """samples_text: a prompt/completion example's data is its completion; a `text` example's (prompt: its first
    half) is the rest of the text, not the whole of it."""
    import importlib

    from transformers import ByT5Tokenizer

    module, tokenizer = importlib.import_module(script), ByT5Tokenizer()
    pair = module.tokenize({"prompt": "abc:", "completion": "cba"}, tokenizer, [tokenizer.eos_token_id])
    text = module.tokenize({"text": "xyzw"}, tokenizer, [tokenizer.eos_token_id])
    prompts = [ids[: module.prompt_length(labels)] for ids, labels in (pair, text)]
    assert module.samples_text(tokenizer, prompts, ["cb", "zw"], [pair[1], text[1]]) == (
        "    'abc:' 'cb' (data: 'cba')\n    'xy' 'zw' (data: 'zw')")


@pytest.mark.parametrize("script", ["sft.py", "scale/sft.py"])
def test_sft_logs_sampled_completions_on_own_data(script, tmp_path, capsys):
    """On a dataset (no gold answer to score), evaluation still shows completions sampled from held-out prompts,
    and the run's last lines before it saves are those samples, beside the data's completions."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base = save_checkpoint(str(tmp_path / "base"), "gpt2", "eos_no_pad", "float32")
    data = write_data(tmp_path / "d.jsonl", "prompt_completion")
    run_in_process(script, "--model-name-or-path", base, "--dataset-name", data, "--max-steps", "2", "--batch-size", "4",
                   "--eval-every", "2", "--eval-size", "8", "--output-dir", "out", cwd=tmp_path)
    acc = EventAccumulator(only_run_dir(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    samples = acc.Tensors("eval/samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    first = split_rows(data, eval_size=8)[1][0]["prompt"]
    assert samples.count("\n") == 3 and samples.startswith(f"    {first!r} "), samples  # the 4 held-out rows
    out = capsys.readouterr().out
    assert "\nheld-out prompts, the completion sampled from each and the data's:\n" + samples + "\n" in out, out


# ------------------------------------------------------------------------------------------------
# Progress on long work: on a terminal, a line every ~10 s with the steps, their rate and the time left
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [sft, scale_sft], ids=lambda m: m.__name__)
def test_progress_is_a_line_every_ten_seconds_on_a_terminal_only(script, monkeypatch, capsys):
    """Progress, one text in every script: at 10 s, 20 of 500 steps done is 2 steps/s and 4 minutes left; at 15 s
    nothing (5 s since the last line); at 21 s, 42 done, its note after. A resumed run's rate counts the steps of
    this run only. Not on a terminal, or with --no-progress (on=False): nothing."""
    import sys

    clock = [1000.0]
    monkeypatch.setattr(script.time, "time", lambda: clock[0])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)

    def run(progress, *calls):  # each Progress made at 1000 s
        progress.start = progress.last = 1000.0
        for seconds, done, note in calls:
            clock[0] = 1000.0 + seconds
            progress(done, note)
        return capsys.readouterr().out

    assert run(script.Progress(500, "steps", True), (5, 10, ""), (10, 20, ""), (15, 30, ""), (21, 42, "reward 0.500")) == (
        "20/500 steps (4%), 2 steps/s, 0:04:00 left\n42/500 steps (8%), 2 steps/s, 0:03:49 left, reward 0.500\n")
    assert run(script.Progress(5000, "steps", True, done=4000), (10, 4020, "")) == (
        "4,020/5,000 steps (80%), 2 steps/s, 0:08:10 left\n")
    assert run(script.Progress(500_000, "env steps", True), (10, 51_230, "")) == (  # a fast rate: no exponent
        "51,230/500,000 env steps (10%), 5,123 env steps/s, 0:01:28 left\n")
    assert run(script.Progress(500, "steps", False), (10, 20, "")) == ""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert run(script.Progress(500, "steps", True), (10, 20, "")) == ""


def progress_runs(tiny_checkpoints):
    """(script, flags of a 2-step run, the unit, what the line ends with) for every script of both tiers."""
    sft_model, rm = ["--model-name-or-path", str(tiny_checkpoints["sft"])], str(tiny_checkpoints["reward_model"])
    steps = ["--max-steps", "2", "--batch-size", "4", "--warmup-steps", "0", "--eval-size", "0"]
    rl = ["--num-iterations", "2", "--batch-size", "4", "--mini-batch-size", "4", "--response-length", "2",
          "--eval-size", "0"]
    lm = {"sft": [*TINY_LM, *steps, "--num-train-examples", "16"],
          "reward_model": [*sft_model, *steps, "--num-train-pairs", "16"],
          "dpo": [*sft_model, *steps, "--num-train-pairs", "16", "--reward-model-path", "None", "--response-length", "2"],
          "rlhf_ppo": [*sft_model, "--reward-model-path", rm, *rl],
          "grpo": [*sft_model, *rl, "--num-generations", "2"]}
    ends = {"rlhf_ppo": r", score -?[\d.]+", "grpo": r", reward -?[\d.]+"}
    runs = [(f"{tier}{name}.py", flags, "steps" if "--max-steps" in flags else "iterations", ends.get(name, ""))
            for tier in ("", "scale/") for name, flags in lm.items()]
    ppo = ["--total-timesteps", "512", "--num-envs", "2", "--num-steps", "128", "--eval-episodes", "0"]
    return runs + [("distill.py", [*sft_model, "--teacher-model-name-or-path", str(tiny_checkpoints["sft"]),
                                   "--num-iterations", "2", "--batch-size", "4", "--eval-size", "0"], "iterations", ""),
                   *[(f"{name}.py", ppo, "env steps", r", return [\d.]+") for name in ("ppo_clip", "ppo_kl")],
                   ("ppo_continuous.py", [*ppo, "--env-id", "Pendulum-v1", "--num-minibatches", "4"], "env steps",
                    r"(, return -?[\d.]+)?")]


@pytest.mark.parametrize("n", range(14))
def test_every_script_shows_its_progress_on_a_terminal(n, tiny_checkpoints, monkeypatch, capsys, tmp_path):
    """A 2-step run of each script, on a terminal, with a line at every step (Progress's 10 s made 0): two lines,
    the RL scripts' with their recent return, reward or score; with --no-progress, none."""
    import importlib
    import re
    import sys

    from conftest import module_name

    script, flags, unit, end = progress_runs(tiny_checkpoints)[n]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(importlib.import_module(module_name(script)).Progress.__init__, "__defaults__", (0, 0.0))
    for progress, lines in (("--progress", 2), ("--no-progress", 0)):
        output = [] if "ppo_" in script else ["--output-dir", f"out{lines}"]
        run_in_process(script, *flags, progress, *output, "--exp-name", f"run{lines}", cwd=tmp_path)
        shown = [line for line in capsys.readouterr().out.splitlines() if re.match(r"[\d,]+/[\d,]+ ", line)]
        half, total = ("256", "512") if "env" in unit else ("1", "2")
        pattern = rf"({half} of {total} {unit} \(50%\)|{total} of {total} {unit} \(100%\)), [\d.e+,]+ {unit}/s, \d+:\d\d:\d\d left{end}"
        assert len(shown) == lines and all(re.fullmatch(pattern, line.replace("/", " of ", 1)) for line in shown), (
            script, shown)


# ------------------------------------------------------------------------------------------------
# The hub out of reach: one line at once that names the way out, not half a minute of retries first
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, flags", [("sft.py", ["--dataset-name", "nobody/no-such-dataset"]),
                                           ("scale/grpo.py", ["--dataset-name", "nobody/no-such-dataset", "--reward-fn", "exact_match"]),
                                           ("reward_model.py", ["--model-name-or-path", "nobody/no-such-model"]),
                                           ("scale/dpo.py", ["--model-name-or-path", "nobody/no-such-model"])])
def test_a_hub_id_with_no_network_is_one_line_at_once(script, flags, monkeypatch, tmp_path):
    """With the hub's host out of reach (the connection refused here), a hub id is looked for in the local cache
    alone, as HF_HUB_OFFLINE=1 does, so the error comes at once (datasets and huggingface_hub retry for 30-50 s
    otherwise), and its line says so and names the way out. A local path never asks the hub."""
    import socket
    import time

    import datasets.config
    import huggingface_hub.constants

    def refused(*args, **kwargs):
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # set back after the test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    start = time.time()
    message = one_line_exit(script, *flags, cwd=tmp_path)
    name = flags[1]  # the hub id
    assert time.time() - start < 10 and huggingface_hub.constants.HF_HUB_OFFLINE, message
    assert message.endswith(f"; offline (the hub does not answer, or HF_HUB_OFFLINE=1) only the local cache is read, "
                            f"and it lacks {name!r}: pass a local directory, or download it where there is a network")
    assert not os.listdir(tmp_path)
