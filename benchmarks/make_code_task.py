"""The small code task of docs/grpo.md's code_execution run: 48 prompts in TRL's format for code rewards, one JSON
object a line, {"prompt": ..., "tests": [assert statements, as MBPP's test_list], "completion": a solution in a
fenced Python block} (the completion for sft.py; grpo.py's code_execution reads `tests`). Eight kinds of function,
six of each with other constants and names.

    python benchmarks/make_code_task.py data/code.jsonl
"""
import json
import sys

KINDS = [  # (prompt, solution, tests) with {k}, the constant, and {name}, the function's name
    ("Write a Python function {name}(x) that returns x plus {k}.", "def {name}(x):\n    return x + {k}",
     ["assert {name}(1) == {k} + 1", "assert {name}(-{k}) == 0", "assert {name}(10) == 10 + {k}"]),
    ("Write a Python function {name}(x) that returns x times {k}.", "def {name}(x):\n    return x * {k}",
     ["assert {name}(2) == 2 * {k}", "assert {name}(0) == 0", "assert {name}(-1) == -{k}"]),
    ("Write a Python function {name}(xs) that returns how many numbers in the list xs are greater than {k}.",
     "def {name}(xs):\n    return sum(1 for x in xs if x > {k})",
     ["assert {name}([]) == 0", "assert {name}([{k}, {k} + 1, {k} + 2]) == 2", "assert {name}([{k} - 1]) == 0"]),
    ("Write a Python function {name}(s) that returns the string s repeated {k} times.",
     "def {name}(s):\n    return s * {k}", ["assert {name}('ab') == 'ab' * {k}", "assert {name}('') == ''"]),
    ("Write a Python function {name}(xs) that returns the list xs without its first {k} items.",
     "def {name}(xs):\n    return xs[{k}:]",
     ["assert {name}(list(range(10))) == list(range({k}, 10))", "assert {name}([]) == []"]),
    ("Write a Python function {name}(n) that returns True when n is divisible by {k}, else False.",
     "def {name}(n):\n    return n % {k} == 0",
     ["assert {name}({k} * 3) is True", "assert {name}({k} * 3 + 1) is False", "assert {name}(0) is True"]),
    ("Write a Python function {name}(xs) that returns the sum of the numbers in xs, plus {k}.",
     "def {name}(xs):\n    return sum(xs) + {k}", ["assert {name}([]) == {k}", "assert {name}([1, 2]) == 3 + {k}"]),
    ("Write a Python function {name}(s) that returns the last {k} characters of the string s.",
     "def {name}(s):\n    return s[-{k}:]", ["assert {name}('abcdefghij') == 'abcdefghij'[-{k}:]",
                                            "assert len({name}('x' * 20)) == {k}"]),
]
NAMES = ["f", "g", "solve", "compute", "answer", "task"]


def rows():
    """The 48 rows: each kind with k = 2..7 and a name of NAMES."""
    out = []
    for prompt, solution, tests in KINDS:
        for i, name in enumerate(NAMES):
            k = i + 2
            fill = lambda text: text.format(name=name, k=k)  # noqa: E731
            out.append({"prompt": fill(prompt), "completion": f"```python\n{fill(solution)}\n```",
                        "tests": [fill(t) for t in tests]})
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows()))
