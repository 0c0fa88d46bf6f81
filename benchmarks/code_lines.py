"""Lines and code lines (not blank, not only a comment, not part of a docstring) of the scripts, per file and
in all, at the working tree or at a commit, and the algorithm's share of each LM script's code lines:

    python benchmarks/code_lines.py                 # the working tree
    python benchmarks/code_lines.py aee7bdc         # a commit (git show); a file it does not have is left out

The algorithm, counted the same way in every file: the code lines of the math section (from its "# The math"
header to check_args: the pure functions with their equations, and in grpo.py and rlhf_ppo.py the reward
functions) and of main's sections that compute it (from a "# ---- rollout" or "# ---- update" comment to the
next "# ---- " one: the loop's rollout and update, and in grpo.py and rlhf_ppo.py the reward the rollout
computes for each completion). Loading, evaluation, logging and the plumbing below the banner are not the
algorithm.
"""
import ast
import io
import os
import subprocess
import sys
import tokenize

LM = ["sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]
SCALE = [f"scale/{script}" for script in LM]
RL = ["ppo_clip", "ppo_kl", "ppo_continuous"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_lines(text):
    """How many lines hold code: a docstring (a string standing alone as a statement: a module's, a function's,
    a class's or an Args field's) is not code, nor a comment, nor a blank line."""
    return len(code_line_numbers(text))


def algorithm_lines(text):
    """Code lines of the math section and of the loop's rollout and update sections (see the docstring above)."""
    lines = text.splitlines(keepends=True)
    spans = []
    if "# The math" in text and "\ndef check_args(" in text:
        spans.append((text[: text.index("# The math")].count("\n"), text[: text.index("\ndef check_args(")].count("\n") + 1))
    markers = [i for i, line in enumerate(lines) if line.strip().startswith("# ---- ")]
    for start, end in zip(markers, markers[1:] + [len(lines)]):
        if lines[start].strip().startswith(("# ---- rollout", "# ---- update")):
            spans.append((start, end))
    code = code_line_numbers(text)
    return len({n for start, end in spans for n in range(start + 1, end + 1)} & code)


def code_line_numbers(text):
    """The 1-based numbers of the lines that hold code (see code_lines)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings |= set(range(node.lineno, node.end_lineno + 1))
    code = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skip:
            code |= set(range(token.start[0], token.end[0] + 1))
    return code - docstrings


def source(script, commit):
    if commit is None:
        with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
            return f.read()
    shown = subprocess.run(["git", "show", f"{commit}:{script}.py"], cwd=ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def main():
    commit = sys.argv[1] if len(sys.argv) > 1 else None
    print("| script | lines | code lines | the algorithm's code lines |\n|-|-|-|-|")
    for family, name in ((LM, "the five LM scripts"), (SCALE, "scale/"), (RL, "the three RL scripts")):
        total, found = 0, False
        for script in family:
            text = source(script, commit)
            if text is None:
                continue
            found, n, algorithm = True, code_lines(text), algorithm_lines(text)
            total += n
            share = f"{algorithm} ({100 * algorithm / n:.1f}%)" if family is not RL else ""
            print(f"| `{script}.py` | {text.count(chr(10)):,} | {n:,} | {share} |")
        if found:
            print(f"| {name} | | {total:,} | |")


if __name__ == "__main__":
    main()
