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
    warmup of a 1-step run is none: no warning.)"""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    run_in_process(script, "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--max-steps", "1", "--eval-size", "0",
                   "--num-train-examples", "64", "--threads", "2", "--output-dir", "out", cwd=tmp_path)
    assert calls == [2]
    assert "warmup" not in capsys.readouterr().out
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
    ("grpo", ["text_prompts", "conversational_prompts"])]] + [("distill.py", ["text_prompts", "conversational_prompts"]),
    ("kto.py", ["explicit", "implicit", "conversational_explicit", "conversational_implicit"])]


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
def test_a_warmup_as_long_as_the_run_is_one_line_and_the_default_fits_the_run(script, decay):
    """--warmup-steps 100 of a 20-step run stops before any work (a run that never leaves its warmup trains at 6%
    or 20% of --lr at most); 10 of 20 is kept; not given, it is the script's default or a tenth of --max-steps."""
    from types import SimpleNamespace

    with pytest.raises(SystemExit) as stop:
        script.settle_warmup(SimpleNamespace(warmup_steps=100, max_steps=20), 100, decay)
    peak = {"cosine": "6%", "linear": "20%"}[decay]  # get_lr's largest value over 20 steps of a 100-step warmup
    assert str(stop.value) == (f"error: --warmup-steps 100 ≥ --max-steps 20: the run would end in its warmup, the "
                               f"learning rate at most {peak} of --lr; lower --warmup-steps or raise --max-steps")
    for given, max_steps, settled in ((10, 20, 10), (None, 20, 2), (None, 5, 0), (None, 5000, 30)):
        args = SimpleNamespace(warmup_steps=given, max_steps=max_steps)
        script.settle_warmup(args, 30, decay)
        assert args.warmup_steps == settled


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


# ------------------------------------------------------------------------------------------------
# A user's own data: lengths that fit it, evaluations that mean something on it, and no silent run
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [sft, dpo, grpo, rlhf_ppo, scale_sft, scale_dpo, scale_grpo, scale_rlhf_ppo],
                         ids=lambda m: m.__name__)
def test_the_lengths_are_the_built_in_task_s_or_on_a_dataset_trl_s(script, capsys):
    """settle_lengths: a flag not given is the built-in task's on it and TRL's on a dataset (SFT, DPO: max_length
    1024; GRPO: 512 prompt tokens), one given is kept; settle_room: a length left to the data is what it needs or
    TRL's, cut to what the model's positions leave, and says so in one line."""
    from types import SimpleNamespace

    builtin, data = SimpleNamespace(dataset_name=None, a=None, b=7), SimpleNamespace(dataset_name="d.jsonl", a=None, b=7)
    for args, a in ((builtin, 64), (data, 1024)):
        script.settle_lengths(args, {"a": (64, 1024), "b": (1, 2)})
        assert (args.a, args.b) == (a, 7)
    args = SimpleNamespace(dataset_name="d.jsonl", response_length=None)
    script.settle_room(args, "response_length", 512, "TRL's max_completion_length", 1024 - 900)
    assert args.response_length == 124 and capsys.readouterr().out == (
        "--response-length 124: TRL's max_completion_length, cut to the 124 positions the model leaves after the "
        "longest prompt\n")
    script.settle_room(args, "response_length", 512, "TRL's", 1000)  # given (or settled): kept, nothing printed
    assert args.response_length == 124 and capsys.readouterr().out == ""


@pytest.mark.parametrize("script", ["sft.py", "scale/sft.py"])
def test_sft_on_a_dataset_keeps_long_examples_and_samples_them_whole(script, tmp_path, capsys):
    """A conversational file whose chats run past the built-in task's 64 tokens: none dropped (TRL's 1024), and the
    samples of the 4 held-out chats run to the longest first answer of theirs (--max-new-tokens 47, printed), not
    to the task's 12."""
    rows = [{"messages": [{"role": "user", "content": f"say {i} " + "x" * (40 + i % 7)},
                          {"role": "assistant", "content": f"{i} " + "y" * (40 + i % 7)},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": "y" * 60}]}
            for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process(script, *TINY_LM, "--dataset-name", "chat.jsonl", "--max-steps", "1", "--batch-size", "4",
                   "--eval-size", "8", "--output-dir", "out", cwd=tmp_path)
    out = capsys.readouterr().out
    held_out = split_rows(tmp_path / "chat.jsonl", eval_size=8)[1]
    longest = max(len(row["messages"][1]["content"]) for row in held_out) + 1  # bytes, and the stop token
    assert "dropped" not in out and f"--max-new-tokens {longest}: the longest completion of the 8" in out, out
    assert "36 training examples" in out


def test_a_user_s_tools_on_the_built_in_task_and_no_call_allowed_are_said(tmp_path, capsys):
    """--tools on the built-in task (it needs multiply): one line; --max-tool-calling-iterations 0: a note (TRL's
    meaning, the baseline without tools); a dataset with tools but no reward: one line that names the reward."""
    (tmp_path / "my_tools.py").write_text("def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n"
                                          "        a: one\n        b: two\n    \"\"\"\n    return a + b\n")
    message = one_line_exit("agent_grpo.py", "--tools", "my_tools.py:add", cwd=tmp_path)
    assert message.startswith("error: --tools my_tools.py:add on the built-in task replaces the multiply"), message
    message = one_line_exit("agent_grpo.py", "--dataset-name", "d.jsonl", "--tools", "my_tools.py:add", cwd=tmp_path)
    assert message.startswith("error: a dataset needs a reward: --reward-fn"), message
    one_line_exit("agent_grpo.py", "--max-tool-calling-iterations", "0", "--model-name-or-path", "none", cwd=tmp_path)
    assert capsys.readouterr().out.startswith("note: --max-tool-calling-iterations 0: no call runs, so no tool is")


@pytest.mark.parametrize("script", ["grpo.py", "rlhf_ppo.py", "agent_grpo.py", "scale/grpo.py", "scale/rlhf_ppo.py"])
def test_a_reward_that_is_always_zero_is_one_line(script, tmp_path):
    """Every term weighed 0 and no missing-EOS penalty: every reward is 0, nothing is learned; one line. With the
    penalty a completion that never stops still scores: it runs."""
    flags = ["--reward-fn", "exact_match", "--reward-weights", "0", "--missing-eos-penalty", "0"]
    flags += ["--reward-model-path", "None"] if "rlhf" in script else []
    message = one_line_exit(script, *flags, cwd=tmp_path)
    assert message.startswith("error: --reward-weights 0.0: every term weighs 0, so every reward is 0"), message


def test_rlhf_ppo_reward_model_path_none_is_no_reward_model(tmp_path):
    """--reward-model-path None means no reward model in every script: rlhf_ppo.py with it and no --reward-fn has
    no reward at all, one line."""
    for script in ("rlhf_ppo.py", "scale/rlhf_ppo.py"):
        message = one_line_exit(script, "--reward-model-path", "None", cwd=tmp_path)
        assert message == "error: --reward-model-path None and no --reward-fn: there is no reward; give one or both"


@pytest.mark.parametrize("script", ["rlhf_ppo.py", "grpo.py", "scale/rlhf_ppo.py", "scale/grpo.py"])
def test_a_reward_model_of_the_built_in_task_never_scores_a_dataset(script, tiny_checkpoints, tmp_path):
    """The reward model's training_args.json says it learned the built-in task: on the user's prompts it would score
    text it has never seen, so the run stops in one line before any work."""
    data = write_data(tmp_path / "prompts.jsonl", "text_prompts")
    rm = str(tiny_checkpoints["reward_model"])
    groups = [] if "rlhf" in script else ["--num-generations", "4"]
    message = one_line_exit(script, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-model-path", rm,
                            "--dataset-name", data, "--reward-fn", "format", "--format-pattern", ".*", "--batch-size",
                            "8", "--mini-batch-size", "8", *groups, cwd=tmp_path)
    assert message.startswith(f"error: the reward model {rm!r} was trained on the built-in task, not for"), message


@pytest.mark.parametrize("script", ["dpo.py", "scale/dpo.py"])
def test_dpo_on_own_data_reports_no_score_of_another_task_and_prints_its_samples(script, tiny_checkpoints, tmp_path,
                                                                              capsys):
    """dpo.py on the user's preference file with the default reward model, trained on the built-in task: a note, no
    eval/score; every evaluation says what it is; the run ends with its held-out prompts (up to 8) and samples."""
    shutil.copytree(tiny_checkpoints["cwd"] / "models" / "reward_model", tmp_path / "models" / "reward_model")
    data = write_data(tmp_path / "prefs.jsonl", "explicit")
    run_in_process(script, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--dataset-name", data,
                   "--max-steps", "2", "--batch-size", "4", "--eval-size", "8", "--eval-every", "2",
                   "--output-dir", "out", cwd=tmp_path)
    out = capsys.readouterr().out
    assert "note: the reward model models/reward_model was trained on the built-in task, not on " in out, out
    assert "eval/score" not in read_scalars(only_run_dir(tmp_path))
    assert "\nevaluation: eval/loss, eval/accuracy over 4 held-out pairs; the rest over 4 prompts, one " in out
    lines = out.splitlines()
    start = lines.index("held-out prompts and the completion sampled from each:")
    assert len(lines[start + 1 : -1]) >= 4 and all(line.startswith("    '") for line in lines[start + 1 : -1]), lines
    assert lines[-1].startswith("saved to out")


def test_run_names_tell_the_output_apart():
    """runs/<exp>__<seed>__<time> at the default --output-dir; with another, its last part after <exp> (but where
    it is <exp>, as the benchmarks name theirs)."""
    from types import SimpleNamespace

    for script in (sft, dpo, grpo, scale_sft, scale_grpo):
        default = SimpleNamespace(exp_name="x", seed=3, output_dir=script.Args.output_dir)
        assert script.run_name(default).startswith("runs/x__3__")
        assert script.run_name(SimpleNamespace(exp_name="x", seed=3, output_dir="models/chat-sft/")).startswith(
            "runs/x__chat-sft__3__")
        assert script.run_name(SimpleNamespace(exp_name="x", seed=3, output_dir="models/x")).startswith("runs/x__3__")
