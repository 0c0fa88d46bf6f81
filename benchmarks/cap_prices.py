"""What issue 45's line caps would cost: each cut below is made on a copy of a top-level LM script, and the copy's
code lines are counted as benchmarks/code_lines.py counts them. Nothing in the repository changes.

    python benchmarks/cap_prices.py             # the table
    python benchmarks/cap_prices.py --run DIR   # also run each cut copy briefly on the built-in task, in DIR

Each cut drops something a user has today (a flag, a data format, an evaluation tag); which to give up, if any, is
the issue's author's choice, so these are prices, not changes. A cut whose anchor text is gone stops with an error.
"""
import ast
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from code_lines import ROOT, algorithm_lines, code_lines  # noqa: E402

LM = ["sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]
CAPS = {"sft": 400, "reward_model": 400, "dpo": 450, "rlhf_ppo": 700, "grpo": 700}


def anchor(text, old, start=0):
    """Where `old` first is in text from `start` on; a cut whose anchor is gone stops the program."""
    if old not in text[start:]:
        sys.exit(f"error: the cut's anchor is gone: {old[:60]!r}")
    return text.index(old, start)


def replace(text, old, new=""):
    anchor(text, old)
    return text.replace(old, new)


def cut_between(text, start, end, new=""):
    """Drop text from `start` up to (not including) `end`."""
    i = anchor(text, start)
    return text[:i] + new + text[anchor(text, end, i) :]


def drop_field(text, name):
    """An Args field and its docstring."""
    tree = ast.parse(text)
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args").body
    for field, doc in zip(body, body[1:] + [None]):
        if isinstance(field, ast.AnnAssign) and field.target.id == name:
            lines = text.splitlines(keepends=True)
            end = doc.end_lineno if isinstance(doc, ast.Expr) else field.end_lineno
            return "".join(lines[: field.lineno - 1] + lines[end:])
    sys.exit(f"error: no field {name!r} in Args")


def drop_defs(text, *names):
    """Top-level definitions (functions, or assignments such as CACHE), decorators included."""
    lines, dropped, found = text.splitlines(keepends=True), set(), set()
    for node in ast.parse(text).body:
        name = getattr(node, "name", None) or (node.targets[0].id if isinstance(node, ast.Assign) else None)
        if name in names:
            found.add(name)
            dropped |= set(range(node.lineno - 1 - len(getattr(node, "decorator_list", [])), node.end_lineno))
    if set(names) - found:
        sys.exit(f"error: no definition {sorted(set(names) - found)} to cut")
    return "".join(line for i, line in enumerate(lines) if i not in dropped)


def no_save_dtype(text):
    """--save-dtype out (the checkpoint is still saved in the dtype of the model it started from)."""
    text = drop_field(text, "save_dtype")
    return cut_between(text, "    if args.save_dtype is not None:\n", "    dtype = AutoConfig")


def sft_no_messages(text):
    """sft.py without the `messages` format (conversational prompt/completion stays)."""
    text = cut_between(text, '    if example.get("messages") is not None:\n', '    if example.get("prompt") is not None')
    text = replace(text, ', ("messages",)]', "]")
    return replace(text, ' and ex.get("messages") is None', "")


def sft_no_text(text):
    """sft.py without the `text` format (after sft_no_messages)."""
    text = cut_between(text, '    if example.get("prompt") is not None', "\n\ndef tokenize_examples",
                       '    prompt_ids, completion_ids = tokenize_pair(tokenizer, example["prompt"], example["completion"], '
                       'stop_ids)\n    return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids\n')
    text = replace(text, '        if ex.get("text") is not None and ex.get("completion") is None:\n'
                         '            ids, labels = ids[:max_length], labels[:max_length]\n')
    return replace(text, ', ("text",)]', "]")


def sft_no_gold_eval(text):
    """sft.py without its sampled and greedy evaluation (eval/gold_accuracy, eval/gold_score and their _greedy)."""
    text = cut_between(text, "    if task_examples:\n", "    for tag, value in logs.items():")
    text = replace(text, "stop_ids, evals, eval_examples if args.dataset_name is None else [], args,\n                     amp",
                   "stop_ids, evals, [], args, amp")
    text = replace(text, '"max_new_tokens": 1, ')
    return drop_defs(drop_field(text, "max_new_tokens"), "generate", "CACHE", "position_ids_of", "levenshtein",
                     "gold_score")


def dpo_no_eval_score(text):
    """dpo.py without the reward model's eval/score (--reward-model-path, --missing-eos-penalty)."""
    text = drop_field(drop_field(text, "reward_model_path"), "missing_eos_penalty")
    text = cut_between(text, "    if not math.isfinite(args.missing_eos_penalty)", "\n\ndef main")
    text = replace(replace(text, "policy, ref, reward = load_models", "policy, ref = load_models"),
                   "evaluate_policy(policy, ref, reward, ", "evaluate_policy(policy, ref, ")
    text = replace(text, "completions, kls, scores = [], [], []", "completions, kls = [], []")
    text = cut_between(text, "            if reward is not None:\n", "        # the text up to the stop token")
    text = cut_between(text, "    if reward is not None and completions:\n", "    if eval_targets is not None")
    text = cut_between(text, "    has_reward = bool(", "    policy, ref = load_no_dropout")
    text = cut_between(text, "    reward = None\n", "\n\ndef eval_prompts_of",
                       "    return tokenizer, stop_ids, policy.to(device), ref.to(device)\n")
    return drop_defs(text, "check_same_vocabulary", "last_token_index", "scalar_head", "sequence_rewards",
                     "response_scores")


def dpo_no_sampled_eval(text):
    """dpo.py without any sampled evaluation (eval/kl, eval/gold_accuracy, eval/gold_score; after
    dpo_no_eval_score): eval/loss and eval/accuracy on the held-out pairs stay."""
    text = cut_between(text, "    completions, kls = [], []\n", "    print(line)\n")
    text = replace(text, "evaluate_policy(policy, ref, tokenizer, stop_ids, logps_of, evals,  # noqa: E731\n"
                         "                                            eval_prompts, eval_ids, eval_targets, args, amp, writer, step)",
                   "evaluate_policy(policy, ref, logps_of, evals, args, writer, step)  # noqa: E731")
    text = replace(text, "def evaluate_policy(policy, ref, tokenizer, stop_ids, logps_of, evals, eval_prompts, eval_ids, "
                         "eval_targets,\n                    args, amp, writer, step):",
                   "def evaluate_policy(policy, ref, logps_of, evals, args, writer, step):")
    text = replace(text, "    train, evals, eval_pair_prompts = [], [], []", "    train, evals = [], []")
    text = replace(text, '            if split == "eval":\n                eval_pair_prompts.append(p)\n')
    text = cut_between(text, "    eval_prompts, eval_ids, eval_targets = eval_prompts_of(", "    if model_positions(policy)",
                       "    longest = args.max_length\n")
    text = replace(text, '"response_length": 1, ')
    text = replace(text, ', "temperature": "> 0"}', "}")
    text = drop_field(drop_field(text, "response_length"), "temperature")
    return drop_defs(text, "generate", "CACHE", "eval_prompts_of", "prompt_row")


# (name, {script: [cuts, applied in order]}): the cuts priced alone and in the sets that reach a cap
PRICES = [
    ("--save-dtype out of all five", {script: [no_save_dtype] for script in LM}),
    ("sft.py: the `messages` format out", {"sft": [sft_no_messages]}),
    ("sft.py: --save-dtype, `messages` and `text` out", {"sft": [no_save_dtype, sft_no_messages, sft_no_text]}),
    ("sft.py: the sampled gold evaluation out", {"sft": [sft_no_gold_eval]}),
    ("dpo.py: eval/score out", {"dpo": [dpo_no_eval_score]}),
    ("dpo.py: --save-dtype and eval/score out", {"dpo": [no_save_dtype, dpo_no_eval_score]}),
    ("dpo.py: every sampled evaluation out", {"dpo": [dpo_no_eval_score, dpo_no_sampled_eval]}),
    ("both: sft.py's gold evaluation and dpo.py's sampled evaluation out",
     {"sft": [sft_no_gold_eval], "dpo": [dpo_no_eval_score, dpo_no_sampled_eval]}),
]


def source(script):
    with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
        return f.read()


def apply(script, cuts):
    text = source(script)
    for cut in cuts:
        text = cut(text)
    ast.parse(text)  # the cut copy is still Python
    return text


def main():
    run_dir = sys.argv[sys.argv.index("--run") + 1] if "--run" in sys.argv else None
    now = {script: code_lines(source(script)) for script in LM}
    print(f"now: {', '.join(f'{s}.py {n}' for s, n in now.items())}; the five {sum(now.values())} (cap 2600)")
    # the algorithm is ≥ 25% of a file's code lines only when the file is at most 4 × the algorithm's lines
    most = ", ".join(f"{s}.py {4 * algorithm_lines(source(s))}" for s in LM)
    print(f"for the algorithm's 25%, at most: {most}\n")
    print("| cut | file: code lines now → after (cap) | the five after |\n|-|-|-|")
    for name, plan in PRICES:
        after = dict(now)
        for script, cuts in plan.items():
            after[script] = code_lines(apply(script, cuts))
        files = "; ".join(f"{s}.py {now[s]} → {after[s]} ({CAPS[s]})" for s in plan)
        print(f"| {name} | {files} | {sum(after.values())} |")
    if run_dir is not None:  # each cut copy trains briefly and evaluates, from sft.py's and reward_model.py's models
        os.makedirs(run_dir, exist_ok=True)
        supervised = ["--max-steps", "10", "--eval-every", "10", "--eval-size", "32"]
        rl = ["--num-iterations", "2", "--batch-size", "16", "--mini-batch-size", "8", "--eval-every", "2",
              "--eval-size", "16"]
        flags = {"sft": supervised, "reward_model": supervised, "dpo": supervised, "rlhf_ppo": rl, "grpo": rl}
        for script in ("sft", "reward_model"):
            subprocess.run([sys.executable, os.path.join(ROOT, f"{script}.py"), *supervised], cwd=run_dir, check=True,
                           capture_output=True)
        for name, plan in PRICES:
            for script, cuts in plan.items():
                with tempfile.NamedTemporaryFile("w", suffix=".py", dir=run_dir, delete=False) as f:
                    f.write(apply(script, cuts))
                out = subprocess.run([sys.executable, f.name, *flags[script], "--output-dir", f"{f.name}.out"],
                                     cwd=run_dir, capture_output=True, text=True)
                last = (out.stdout + out.stderr).strip().splitlines()[-2:]
                print(f"{name} ({script}.py): rc {out.returncode}; {' / '.join(last)}")


if __name__ == "__main__":
    main()
