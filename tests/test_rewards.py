"""Rewards as plain Python functions (--reward-fn) in grpo.py and rlhf_ppo.py: the built-in rewards by hand on
tricky strings, how the terms add up (None as TRL treats it), loading a user's function by path and by module
name, its errors as one line, and the pipeline sft.py -> grpo.py / rlhf_ppo.py on a small arithmetic task."""
import json
import shutil
import signal
from decimal import Decimal

import pytest
import torch
from conftest import TINY_LM, one_line_exit, read_scalars, run_in_process
from lm_models import save_checkpoint

import grpo
import rlhf_ppo


# ------------------------------------------------------------------------- the built-in rewards, by hand
@pytest.mark.parametrize("text,number", [
    ("12 + 30 = 42\n#### 42", Decimal(42)),
    ("She pays $1,234 in all.\n#### 1,234", Decimal(1234)),       # thousands separators
    ("#### 5 apples, not 6", Decimal(5)),                         # the first number after the last ####
    ("first #### 3, then #### -8", Decimal(-8)),
    ("it is 7, not 8 ####", None),                                # nothing after ####: no answer
    ("The answer is -5.", Decimal(-5)),                           # a negative number; the full stop is no decimal point
    ("3 apples and 4 pears, 7 in all", Decimal(7)),               # several numbers: the last
    ("1,2,3", Decimal(3)),                                        # not a thousands separator: three numbers
    ("no number here", None),
    ("so \\boxed{ 72 }", Decimal(72)),                            # whitespace in the box
    ("\\boxed{3} first, then \\boxed{1,000.0}", Decimal(1000)),   # the last box, 1,000.0 = 1000
    ("\\boxed{\\text{72}} beats 5", Decimal(72)),                 # braces nested in the box
    ("\\boxed{\\frac{1}{2}}", None),                              # two numbers in the box: not one answer
    ("\\boxed{12", Decimal(12)),                                  # a box never closed: the last number
    ("  72.50\n", Decimal("72.5")),
])
def test_answer_number_by_hand(text, number):
    assert grpo.answer_number(text) == number


def test_last_boxed_matches_braces():
    assert grpo.last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert grpo.last_boxed("no box") is None and grpo.last_boxed("\\boxed{open") is None


def test_numeric_match_by_hand():
    completions = ["12 + 30 = 42\n#### 42", "42.0", "the sum is 1,042", "#### 43", "\\boxed{42}", "forty-two",
                   [{"role": "assistant", "content": "#### -7"}]]
    targets = ["#### 42", "42", "1042", "42", "30 + 12 = 42\n#### 42", "42", "-7"]
    assert grpo.numeric_match(None, completions, targets) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # a target without a number is no numeric question: None, whatever the completion
    assert grpo.numeric_match(None, ["42", "x"], ["forty-two", ""]) == [None, None]


def test_exact_match_strips_whitespace_only():
    assert grpo.exact_match(None, [" 1234\n", "1234", "01234", [{"role": "assistant", "content": "ab "}]],
                            ["1234", " 1234 ", "1234", "ab"]) == [1.0, 1.0, 0.0, 1.0]


def test_format_match_is_a_full_match_across_lines():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = ["<think>a\nb</think>\n<answer>3</answer>", "<think>a</think><answer>3</answer> extra",
                   "<answer>3</answer>"]
    assert grpo.format_match(None, completions, pattern=pattern) == [1.0, 0.0, 0.0]


def test_gold_is_the_built_in_gold_score():
    assert grpo.gold(None, ["1234", "1243", ""], ["1234"] * 3) == [1.0, 0.5, 0.0]


def test_combine_rewards_weights_and_none_by_hand():
    """r = Σ_k w_k r_k over the terms that apply: a None (NaN) adds nothing (TRL's nansum); no term at all leaves
    the completion unscored, NaN (TRL 1.16; the old nansum gave it 0, a reward like any other)."""
    nan = float("nan")
    table = torch.tensor([[1.0, 0.5], [nan, 2.0], [nan, nan], [0.0, -1.0]])
    rewards = grpo.combine_rewards(table, (2.0, -0.5))
    assert rewards[[0, 1, 3]].tolist() == [1.75, -1.0, 0.5] and rewards[2].isnan()


@pytest.mark.parametrize("script", [grpo, rlhf_ppo], ids=["grpo", "rlhf_ppo"])
def test_term_means_by_hand(script):
    """Each term's mean over the completions it applies to (not over all), the reward model's under its own tag;
    a term that applies to no completion is left out, not logged as 0 or NaN."""
    nan = float("nan")
    table = torch.tensor([[1.0, nan, 2.0, nan], [nan, nan, 0.5, 4.0], [0.25, nan, 0.5, nan]])
    means = script.term_means(table, ["format", "gold", "exact", "reward_model"], "rewards/", "objective/score")
    assert means == {"rewards/format": 0.625, "rewards/exact": 1.0, "objective/score": 4.0}


def test_samples_markdown_by_hand():
    """The eval samples' table for TensorBoard: a header and a separator with a column per reward term, one row per
    sample (at most n), a conversation by its last message, each cell on one line with its `|` escaped, a term
    that did not apply blank."""
    nan = float("nan")
    prompts = ["sort 21:", [{"role": "user", "content": "a|b"}]]
    completions = ["12", [{"role": "assistant", "content": "x\ny"}]]
    rewards, table = torch.tensor([1.0, -0.5]), torch.tensor([[1.0, nan], [0.25, 0.5]])
    lines = grpo.samples_markdown(prompts, completions, rewards, table, ["gold", "format"]).splitlines()
    assert lines == ["| prompt | completion | reward | gold | format |", "|-|-|-|-|-|",
                     "| sort 21: | 12 | 1.000 | 1.000 |  |", "| a\\|b | x\\ny | -0.500 | 0.250 | 0.500 |"]
    assert grpo.samples_markdown(prompts, completions, rewards, table, ["gold", "format"], n=1).splitlines() == lines[:3]


# ------------------------------------------------------------------------- loading and calling user functions
USER_FILE = '''
def correct_length(prompts, completions, target, **columns):
    """1 where the completion is as long as the target; None where the row says it does not apply."""
    return [None if skip else float(len(c) == len(t)) for c, t, skip in zip(completions, target, columns["skip"])]
'''


def test_a_user_function_by_path_and_by_module_name(tmp_path, monkeypatch):
    # a file runs as a module, not as a program: its __main__ block (here one that would stop the run) does not run
    (tmp_path / "my_rewards.py").write_text(USER_FILE + "\nif __name__ == '__main__':\n    raise SystemExit('ran')\n")
    monkeypatch.chdir(tmp_path)
    by_path = grpo.load_reward_functions(["my_rewards.py:correct_length", "numeric_match"], grpo.BUILTIN_REWARDS, None)
    by_module = grpo.load_reward_functions(["my_rewards:correct_length"], grpo.BUILTIN_REWARDS, None)
    assert [name for name, _ in by_path] == ["correct_length", "numeric_match"]
    assert by_module[0][0] == "correct_length"
    columns = {"target": ["12", "3", "7"], "skip": [False, False, True]}
    guard = grpo.RewardGuard(["correct_length", "numeric_match"], 120.0, 3, [])
    table = grpo.reward_terms(by_path, ["p"] * 3, ["12", "#### 3", "7"], columns, guard)
    assert torch.equal(table.isnan(), torch.tensor([[False, False], [False, False], [True, False]]))
    assert table.nan_to_num(-9).tolist() == [[1.0, 1.0], [0.0, 1.0], [-9.0, 1.0]]
    assert grpo.reward_columns([{"prompt": "p", "target": "1", "skip": 0}]) == {"target": ["1"], "skip": [0]}


def one_line(fn, *args):
    """The message a call stops the run with: one line that starts with `error:`."""
    with pytest.raises(SystemExit) as stop:
        fn(*args)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_bad_reward_functions_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_FILE + "\ndef no_keywords(x):\n    return [1.0]\n")
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    monkeypatch.chdir(tmp_path)
    load = lambda *specs: grpo.load_reward_functions(specs, grpo.BUILTIN_REWARDS, None)  # noqa: E731
    assert "exact_match, numeric_match" in one_line(load, "nope")
    assert "'missing.py' does not exist" in one_line(load, "missing.py:f")
    assert "has no function 'f'" in one_line(load, "my_rewards.py:f")
    assert "No module named 'no_such_pkg'" in one_line(load, "no_such_pkg:f")
    assert "importing 'broken.py' failed" in one_line(load, "broken.py:f")
    assert "--format-pattern" in one_line(load, "format")
    assert "not a regular expression" in one_line(grpo.load_reward_functions, ["format"], grpo.BUILTIN_REWARDS, "(")
    assert "given twice" in one_line(load, "gold", "gold")
    functions = load("my_rewards.py:no_keywords")
    assert "no_keywords(prompts, completions, target)" in one_line(grpo.check_reward_signatures, functions,
                                                                   ["prompt", "target"])
    # the built-ins need a `target` column; a dataset without one is told so, not how to write a function
    for builtin in ("numeric_match", "exact_match", "gold"):
        line = one_line(grpo.check_reward_signatures, load(builtin), ["prompt", "question"])
        assert f"the built-in reward '{builtin}'" in line and "`target` column" in line and "def " not in line, line


@pytest.mark.parametrize("body,words", [
    ("return [1 / len(c) for c in completions]", ["raised ZeroDivisionError: division by zero"]),
    ("return [float('nan') if c == '' else 1.0 for c in completions]", ["returned nan"]),
    ("return ['1' for c in completions]", ["returned '1'"]),
    ("return [1.0]", ["returned 1 values for 3 completions"]),
])
def test_a_reward_that_fails_as_often_as_max_reward_failures_stops_the_run_naming_it(body, words):
    """With --max-reward-failures 1, one call that fails on every completion stops the run in one line that names
    the function and its failure: grpo.py's reward_terms, and scale/'s, which tells every rank."""
    from scale import grpo as scale_grpo

    def f(prompts, completions, **columns):
        return eval(body.removeprefix("return "))

    for module in (grpo, scale_grpo):
        message = one_line(module.reward_terms, [("f", f)], ["a", "b", "c"], ["x", "", "z"], {},
                           module.RewardGuard(["f"], 120.0, 1, []))
        for word in ["reward function 'f' failed on every completion of 1 calls in a row", *words, "nothing saved"]:
            assert word in message, message


def test_the_reward_functions_section_runs_the_same_in_rlhf_ppo():
    """The text is checked in test_copies; here the objects: rlhf_ppo's built-ins are its own functions."""
    assert set(rlhf_ppo.BUILTIN_REWARDS) == {"gold", "exact_match", "numeric_match", "format", "code_execution"}
    assert rlhf_ppo.numeric_match(None, ["#### 1,000"], ["1000.0"]) == [1.0]


# ------------------------------------------------------------------------- end to end
def arithmetic(n, seed):
    """n two-term sums as word problems: (question, GSM8K-style answer)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append((f"Ann has {a} pens and gets {b} more. How many?", f"{a} + {b} = {a + b}\n#### {a + b}"))
    return rows


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")


@pytest.fixture(scope="module")
def arithmetic_sft(tmp_path_factory):
    """sft.py on prompt/completion rows of the arithmetic task: a directory with the model and the RL rows."""
    cwd = tmp_path_factory.mktemp("arithmetic")
    write_jsonl(cwd / "sft.jsonl", [{"prompt": q, "completion": " " + a} for q, a in arithmetic(400, 1)])
    write_jsonl(cwd / "rl.jsonl", [{"prompt": q, "target": a} for q, a in arithmetic(200, 2)])
    run_in_process("sft.py", *TINY_LM, "--dataset-name", "sft.jsonl", "--max-length", "96", "--max-steps", "10",
                   "--eval-every", "10", "--batch-size", "16", "--eval-size", "16", "--output-dir", "models/sft", cwd=cwd)
    return cwd


RL = ["--model-name-or-path", "models/sft", "--dataset-name", "rl.jsonl", "--response-length", "20",
      "--max-prompt-length", "64", "--eval-every", "2", "--eval-size", "8"]


def last_run(cwd, exp_name):
    import glob

    return sorted(glob.glob(str(cwd / "runs" / f"{exp_name}__*")))[-1]


def samples_text(run_dir):
    """The TensorBoard text of a run's last evaluation: a Markdown table of prompt, completion and rewards."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors("eval/samples/text_summary")[-1].tensor_proto.string_val[0].decode()


def test_sft_then_grpo_with_the_numeric_reward(arithmetic_sft):
    """grpo.py on prompt/target rows with the numeric reward (and exact_match, weight 0): each function logged
    under its own tag, in training and evaluation, the rewards in their range, a table of samples."""
    cwd = arithmetic_sft
    run_in_process("grpo.py", *RL, "--reward-fn", "numeric_match", "--reward-fn", "exact_match", "--reward-weights",
                   "1", "0", "--num-iterations", "2", "--batch-size", "16", "--num-generations", "4",
                   "--mini-batch-size", "16", "--exp-name", "grpo_numeric", "--output-dir", "models/grpo", cwd=cwd)
    run_dir = last_run(cwd, "grpo_numeric")
    logs = read_scalars(run_dir)
    for tag in ("rewards/numeric_match", "rewards/exact_match", "eval/reward", "eval/rewards/numeric_match",
                "eval/rewards/exact_match", "objective/reward"):
        assert tag in logs, tag
    assert "eval/gold_accuracy" not in logs and "eval/score" not in logs  # no built-in task, no reward model
    assert all(0 <= v <= 1 for tag in ("rewards/numeric_match", "eval/rewards/numeric_match") for _, v in logs[tag])
    assert all(-1 <= v <= 1 for _, v in logs["objective/reward"])  # 0, 1, or the missing-EOS penalty
    text = samples_text(run_dir).split("\n")
    assert text[0] == "| prompt | completion | reward | numeric_match | exact_match |" and len(text) == 2 + 8, text


def test_sft_then_rlhf_ppo_with_the_numeric_reward_and_no_reward_model(arithmetic_sft, capsys):
    """rlhf_ppo.py with --reward-fn and --reward-model-path None: three models, the critic from the SFT model."""
    cwd = arithmetic_sft
    run_in_process("rlhf_ppo.py", *RL, "--reward-fn", "numeric_match", "--reward-model-path", "None",
                   "--num-iterations", "2", "--batch-size", "8",
                   "--mini-batch-size", "8", "--exp-name", "ppo_numeric", "--output-dir", "models/ppo", cwd=cwd)
    assert "3 model(s) in memory" in capsys.readouterr().out
    logs = read_scalars(last_run(cwd, "ppo_numeric"))
    for tag in ("rewards/numeric_match", "eval/rewards/numeric_match", "eval/reward", "objective/reward",
                "objective/rlhf_reward"):
        assert tag in logs, tag
    assert "objective/score" not in logs and "eval/score" not in logs
    assert [v for _, v in logs["policy/first_ratio_max_error"]] == [0.0, 0.0]


@pytest.mark.parametrize("script", ["grpo.py", "rlhf_ppo.py", "dpo.py", "scale/grpo.py", "scale/rlhf_ppo.py",
                                    "scale/dpo.py"])
def test_a_reward_model_with_another_tokenizer_is_one_line(script, tiny_checkpoints, tmp_path):
    """A reward model reads the policy's token ids: one whose tokenizer has another vocabulary (here one token more)
    would score other text than the policy wrote. One line names it, before any model is loaded."""
    from transformers import AutoTokenizer

    models = tiny_checkpoints["cwd"] / "models"
    other = tmp_path / "other_reward_model"
    shutil.copytree(models / "reward_model", other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    policy = "--model-name-or-path"
    message = one_line_exit(script, policy, str(models / "sft"), "--reward-model-path", str(other), cwd=tmp_path)
    assert "another tokenizer" in message and str(other) in message, message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", ["grpo.py", "rlhf_ppo.py"])
def test_weights_follow_the_order_of_the_terms_the_reward_model_last(script, small_checkpoints, tmp_path, capsys):
    """--reward-fn gold, --reward-fn format and the reward model weighted 0, 0 and 1: the reward is exactly the
    reward model's score (missing-EOS penalty included), in training and evaluation, while the gold and format
    functions, whose scores are not 0, are still logged: the small SFT model's completions stop and come near
    their targets, and they are digits, which the --format-pattern given matches. With the weights in the wrong
    order the reward would be another term; with them ignored, the sum of the three; with the pattern ignored,
    the format score another."""
    grpo_flags = ["--num-generations", "4"] if script == "grpo.py" else []
    run_in_process(script, "--model-name-or-path", str(small_checkpoints["sft"]), "--reward-model-path",
                   str(small_checkpoints["reward_model"]), "--reward-fn", "gold", "--reward-fn", "format",
                   "--format-pattern", "[0-9]*",
                   "--reward-weights", "0", "0", "1", "--num-iterations", "1", "--batch-size", "8",
                   "--mini-batch-size", "8", "--eval-size", "8", *grpo_flags, cwd=tmp_path)
    assert f"{4 if script == 'rlhf_ppo.py' else 3} model(s) in memory" in capsys.readouterr().out
    logs = read_scalars(str(next((tmp_path / "runs").iterdir())))
    assert logs["objective/reward"] == logs["objective/score"] and logs["eval/reward"] == logs["eval/score"]
    assert logs["objective/reward"] != logs["rewards/gold"] and "eval/rewards/gold" in logs
    assert logs["rewards/gold"][0][1] > 0.1 and logs["eval/rewards/gold"][0][1] > 0.1, logs["rewards/gold"]
    assert logs["rewards/format"][0][1] > 0.5 and logs["eval/rewards/format"][0][1] > 0.5, logs["rewards/format"]


@pytest.mark.parametrize("script", ["grpo.py", "scale/grpo.py"])
def test_conversational_prompts_reach_the_reward_as_messages(tmp_path, capsys, script):
    """A chat model (random tiny Llama with a Llama 3 template) on conversational prompts: the user's function
    receives the prompts as messages (with scale/'s --system-prompt, the system message first), and each
    completion as a list with one assistant message, as TRL passes them; its values (the length of the
    completion) are what grpo.py logs."""
    save_checkpoint(str(tmp_path / "chat"), "llama", "chat_eot", "float32")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": f"sort {i} 1:"}], "target": f"1 {i}"}
                                       for i in range(16)])
    first = "{'role': 'system', 'content': 'Be brief.'}" if script.startswith("scale/") else "{'role': 'user'"
    (tmp_path / "check.py").write_text(
        "def shape(prompts, completions, target, **columns):\n"
        f"    assert all(str(p[0]).startswith(\"{first}\") and p[-1]['role'] == 'user' for p in prompts)\n"
        "    assert all(len(c) == 1 and c[0]['role'] == 'assistant' for c in completions)\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    system = ["--system-prompt", "Be brief."] if script.startswith("scale/") else []
    run_in_process(script, "--model-name-or-path", "chat", "--dataset-name", "p.jsonl", *system,
                   "--reward-fn", "check.py:shape", "--response-length", "4", "--num-iterations", "1", "--batch-size",
                   "8", "--num-generations", "4", "--mini-batch-size", "8", "--eval-size", "4", cwd=tmp_path)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logs = read_scalars(str(next((tmp_path / "runs").iterdir())))
    assert logs["rewards/shape"][0][1] > 0 and "eval/rewards/shape" in logs


def test_a_system_prompt_on_text_data_is_one_line():
    """scale/'s --system-prompt: on text data or the built-in task one line; a conversation that has a system message
    keeps it; with no prompt column, chosen and rejected both get it."""
    import tyro

    from scale import grpo as scale_grpo

    args = tyro.cli(scale_grpo.Args, args=["--dataset-name", "t.jsonl", "--system-prompt", "x", "--reward-fn", "exact_match"])
    assert "conversational" in one_line(scale_grpo.add_system_prompt, [{"prompt": "sort 2 1:"}], args)
    args.dataset_name = None
    assert "the built-in task is text" in one_line(scale_grpo.add_system_prompt, [], args)
    args.dataset_name, args.system_prompt = "t.jsonl", "s"
    rows = scale_grpo.add_system_prompt([{"messages": [{"role": "system", "content": "keep"}]},
                                         {"chosen": [], "rejected": []}], args)
    assert rows == [{"messages": [{"role": "system", "content": "keep"}]},
                    {"chosen": [{"role": "system", "content": "s"}], "rejected": [{"role": "system", "content": "s"}]}]


@pytest.mark.parametrize("script,model_flag", [
    ("scale/sft.py", None), ("scale/reward_model.py", "--model-name-or-path"), ("scale/dpo.py", "--model-name-or-path"),
    ("scale/rlhf_ppo.py", "--model-name-or-path"), ("scale/grpo.py", "--model-name-or-path")])
def test_every_scale_script_checks_the_system_prompt_before_loading_a_model(script, model_flag, tmp_path, monkeypatch):
    """Each scale/ main hands its rows to add_system_prompt: --system-prompt on the built-in task (text) is one line,
    before any model is loaded or placed (a main that skipped it would train with the flag silently ignored)."""
    import importlib

    module = importlib.import_module(script[: -len(".py")].replace("/", "."))

    def refuse(*args, **kwargs):
        raise AssertionError(f"{script} reached a model with --system-prompt on text data")

    monkeypatch.setattr(module, "load_no_dropout", refuse)
    monkeypatch.setattr(module, "place_model", refuse)
    model = [model_flag, save_checkpoint(str(tmp_path / "chat"), "llama", "chat_eot", "float32")] if model_flag else []
    size = ["--num-train-examples", "16", "--eval-size", "4"] if script == "scale/sft.py" else []
    message = one_line_exit(script, "--system-prompt", "Be brief.", *model, *size, cwd=tmp_path)
    assert "--system-prompt needs conversational data; the built-in task is text" in message


@pytest.mark.parametrize("script", ["grpo.py", "rlhf_ppo.py"])
@pytest.mark.parametrize("flags,words", [
    (["--reward-fn", "nope"], ["--reward-fn 'nope'", "MODULE_OR_FILE:NAME"]),
    (["--reward-fn", "missing.py:f"], ["'missing.py' does not exist"]),
    (["--reward-fn", "numeric_match", "--reward-model-path", "None", "--reward-weights", "1", "2"],
     ["2 values for 1 reward terms"]),
    (["--reward-fn", "bad.py:bad"], ["'bad' cannot be called as bad(prompts, completions, target)"]),
])
def test_bad_reward_flags_are_one_line_before_any_model_is_loaded(script, flags, words, tmp_path, monkeypatch):
    """No model exists at --model-name-or-path: the reward's error comes first."""
    import importlib

    import tyro

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text("def bad(completion):\n    return [0.0]\n")
    write_jsonl(tmp_path / "t.jsonl", [{"prompt": "sort 2 1:", "target": "12"}] * 8)
    module = importlib.import_module(script[:-3])
    args = tyro.cli(module.Args, args=["--model-name-or-path", "models/none", "--dataset-name", "t.jsonl", *flags])
    message = one_line(module.main, args)
    for word in words:
        assert word in message, message
    assert not (tmp_path / "runs").exists()


def test_a_nan_reward_stops_the_run_and_saves_nothing(arithmetic_sft, tmp_path, monkeypatch):
    import shutil

    import tyro

    shutil.copytree(arithmetic_sft / "models" / "sft", tmp_path / "models" / "sft")
    shutil.copy(arithmetic_sft / "rl.jsonl", tmp_path / "rl.jsonl")
    (tmp_path / "nan.py").write_text("def nan_reward(prompts, completions, **columns):\n"
                                     "    return [float('nan')] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    args = tyro.cli(grpo.Args, args=[*RL, "--reward-fn", "nan.py:nan_reward", "--num-iterations", "1", "--batch-size",
                                     "8", "--num-generations", "4", "--mini-batch-size", "8"])
    message = one_line(grpo.main, args)
    assert "reward function 'nan_reward' failed on every completion of 3 calls in a row" in message  # eval, 1, eval
    assert "returned nan" in message and "nothing saved" in message
    assert not (tmp_path / "models" / "grpo").exists()
