"""The README is a manual a newcomer reads in ten minutes: at most 3,200 words (studies, profiles and variant
tables go to docs/), and its table of where each script's loop and banner are says what the files hold; docs/tags.md
names every tag the scripts log."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["ppo_clip", "ppo_kl", "ppo_continuous", "sft", "reward_model", "dpo", "rlhf_ppo", "grpo", "distill", "agent_grpo", "kto"]


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_the_readme_has_at_most_3200_words():
    assert len(readme().split()) <= 3200


def layout(script):
    """(lines, the line main's loop starts at, the banner's first line) of a script, 1-based."""
    with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
        lines = f.read().split("\n")[:-1]
    loop = next(i for i, line in enumerate(lines, 1) if re.match(r"    for (step|iteration) in range\(", line))
    banner = next(i for i, line in enumerate(lines, 1) if line.startswith("# Plumbing")) - 1
    return len(lines), loop, banner


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_readme_table_of_lines_is_true(script):
    lines, loop, banner = layout(script)
    row = f"| `{script}.py` | {lines} | {loop} ({round(100 * loop / lines)}%) | {banner} |"
    assert row in readme(), row


ALL_SCRIPTS = SCRIPTS + [f"scale/{s}" for s in ("sft", "reward_model", "dpo", "rlhf_ppo", "grpo")]


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_every_tag_the_script_names_is_in_docs_tags(script):
    """docs/tags.md is the reference of every TensorBoard tag: each tag a script writes as a literal ("losses/loss",
    in add_scalar or in a dict of logs) is one of its `tag` entries. The tags made from a name (sft's `_greedy`
    ones, `rewards/<name>`) are written there by hand."""
    with open(os.path.join(ROOT, "docs", "tags.md"), encoding="utf-8") as f:
        documented = set(re.findall(r"`([a-z]+/[a-z_0-9/<>]+)`", f.read()))
    with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
        source = f.read()
    prefixes = "charts|losses|objective|policy|val|eval|train|rewards|rollout|tools"
    tags = set(re.findall(rf'"((?:{prefixes})/[a-z_0-9/]*[a-z_0-9])"', source))  # not a prefix such as "rewards/"
    assert len(tags) >= 5, tags  # the pattern still finds the script's tags
    assert tags <= documented, sorted(tags - documented)


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_help_shows_what_the_script_implements(script):
    """`python X.py --help` is the manual: tyro is handed the module docstring (what the script implements and its
    example commands), in every script of both tiers."""
    with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
        source = f.read()
    assert source.count("tyro.cli(Args, description=__doc__)") == 1


@pytest.mark.slow
def test_help_of_sft_prints_its_docstring():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), "--help"], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="200"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Supervised fine-tuning" in proc.stdout and "python sft.py --model-name-or-path" in proc.stdout


@pytest.mark.slow
def test_the_own_data_example_works_as_written(tmp_path):
    """The README's own-data example, run as written (its `python` this interpreter, sft.py and grpo.py this
    checkout's): it makes words.jsonl and chat.jsonl, trains on each, each run ending by printing 8 held-out
    prompts with the completion sampled from each and the data's (of a chat, the assistant turn after the prompt),
    mostly right, and grpo.py then trains from the first model on the `target` column."""
    import subprocess
    import sys

    from conftest import read_scalars

    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme(), re.DOTALL) if "words.jsonl" in b)
    assert len(block.strip().splitlines()) == 10, block
    script = re.sub(r"python (sft|grpo)\.py", lambda m: f"{sys.executable} {os.path.join(ROOT, m.group(1))}.py",
                    block).replace("python -", f"{sys.executable} -")
    proc = subprocess.run(["bash", "-c", "set -e\n" + script], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error" not in proc.stdout + proc.stderr and (tmp_path / "models" / "reverse-grpo" / "config.json").exists()
    lines = proc.stdout.splitlines()
    header = "held-out prompts, the completion sampled from each and the data's:"
    starts = [i for i, line in enumerate(lines) if line == header]
    assert len(starts) == 2, lines
    for start, prompt, saved in zip(starts, (r"'(\w+):'", r"'user: reverse (\w+)</s>assistant: '"),
                                    ("reverse-sft", "chat-sft")):
        samples = [re.fullmatch(rf"    {prompt} '(\w*)' \(data: '(\w+)'\)", line) for line in lines[start + 1 : start + 9]]
        assert all(samples) and lines[start + 9] == f"saved to models/{saved}", lines[start:]
        assert all(data == word[::-1] for word, _, data in (m.groups() for m in samples))  # the data's answer
        assert sum(answer == data for _, answer, data in (m.groups() for m in samples)) >= 6, lines[start:]  # mostly
    runs = {run.name.split("__")[1]: str(run) for run in (tmp_path / "runs").iterdir()}  # <exp>__<output>__<seed>__<time>
    for name in ("reverse-sft", "chat-sft"):
        logs = read_scalars(runs[name])
        first, last = logs["losses/loss"][0][1], logs["losses/loss"][-1][1]
        assert 0 < last < first / 2, logs["losses/loss"]  # it learned: a cross-entropy, positive, and halved
    assert len(read_scalars(runs["reverse-grpo"])["rewards/exact_match"]) == 10  # grpo.py read the target column
