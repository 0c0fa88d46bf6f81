"""Lines and code lines (not blank, not only a comment, not part of a docstring) of the scripts, per file and
in all, at the working tree or at a commit:

    python benchmarks/code_lines.py                 # the working tree
    python benchmarks/code_lines.py b089432         # a commit (git show)
"""
import ast
import io
import os
import subprocess
import sys
import tokenize

LM = ["sft", "reward_model", "dpo", "rlhf_ppo", "grpo"]
RL = ["ppo_clip", "ppo_kl", "ppo_continuous"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_lines(text):
    """How many lines hold code: a docstring (a string standing alone as a statement: a module's, a function's,
    a class's or an Args field's) is not code, nor a comment, nor a blank line."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings |= set(range(node.lineno, node.end_lineno + 1))
    code = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skip:
            code |= set(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def source(script, commit):
    if commit is None:
        with open(os.path.join(ROOT, f"{script}.py"), encoding="utf-8") as f:
            return f.read()
    return subprocess.run(["git", "show", f"{commit}:{script}.py"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def main():
    commit = sys.argv[1] if len(sys.argv) > 1 else None
    print("| script | lines | code lines |\n|-|-|-|")
    for family in (LM, RL):
        total = 0
        for script in family:
            text = source(script, commit)
            total += code_lines(text)
            print(f"| `{script}.py` | {text.count(chr(10)):,} | {code_lines(text):,} |")
        print(f"| {'the five LM scripts' if family is LM else 'the three RL scripts'} | | {total:,} |")


if __name__ == "__main__":
    main()
