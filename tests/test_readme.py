"""The README is a manual a newcomer reads in ten minutes: at most 3,200 words (studies, profiles and variant
tables go to docs/), and its table of where each script's loop and banner are says what the files hold."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["ppo_clip", "ppo_kl", "ppo_continuous", "sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]


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
