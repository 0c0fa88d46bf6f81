"""docs/grpo.md's code reward figures and its code task, on the CPU.

    python benchmarks/code_rewards.py --write data/code.jsonl     # the code task (48 rows), for sft.py and grpo.py
    python benchmarks/code_rewards.py                             # the speed figures

The code task: prompts in TRL's format for code rewards, one JSON object a line, {"prompt": ..., "tests": [assert
statements, as MBPP's test_list], "completion": a solution in a fenced Python block} (the completion for sft.py;
--reward-fn code_execution reads `tests`): eight kinds of function, six of each with other constants and names.

The speed figures, each the median and range of 3 rounds, the settings alternating within each round: (1) the reward
step (grpo.py's call_reward) on a batch of 64 of a reward function that sleeps 50 ms per completion, in the trainer
(--reward-num-workers 0) and in 1 and 2 worker processes; (2) code_execution on the task's 48 solutions, 0 and 2
workers; (3) the sandbox's cost per program: run_sandboxed on `pass` against exec() in this process."""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402

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
            constants = {"name": name, "k": i + 2}
            out.append({"prompt": prompt.format(**constants),
                        "completion": f"```python\n{solution.format(**constants)}\n```",
                        "tests": [t.format(**constants) for t in tests]})
    return out


def sleepy(prompts, completions, **columns):
    """A reward function that takes 50 ms per completion (a slow checker, an API call)."""
    time.sleep(0.05 * len(completions))
    return [1.0] * len(completions)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_and_range(times):
    return f"{statistics.median(times):.3f} s (range {min(times):.3f}-{max(times):.3f})"


def speed():
    python, task = grpo.sandbox_python(), rows()
    functions = {"sleepy": sleepy, "code_execution": lambda **kw: grpo.code_execution(**kw, python=python)}
    guards = {n: grpo.RewardGuard(list(functions), 600.0, 3, [grpo.Worker(functions) for _ in range(n)])
              for n in (0, 1, 2)}
    sleep_times, code_times, sandbox, in_process = {n: [] for n in guards}, {0: [], 2: []}, [], []
    batch = {"prompts": ["p"] * 64, "completions": ["c"] * 64}
    code = {"prompts": [r["prompt"] for r in task], "completions": [r["completion"] for r in task]}
    for _ in range(3):
        for n, guard in guards.items():
            sleep_times[n].append(timed(lambda g=guard: grpo.call_reward(g, "sleepy", sleepy, **batch, columns={})))
        for n in code_times:
            code_times[n].append(timed(lambda g=guards[n]: grpo.call_reward(
                g, "code_execution", functions["code_execution"], **code, columns={"tests": [r["tests"] for r in task]})))
        sandbox.append(timed(lambda: [grpo.run_sandboxed(python, "pass", ["pass"]) for _ in range(20)]) / 20)
        in_process.append(timed(lambda: [exec(compile("pass", "<p>", "exec"), {}) for _ in range(20)]) / 20)
    for n, times in sleep_times.items():
        print(f"reward step, 64 completions x 50 ms, --reward-num-workers {n}: {median_and_range(times)}")
    for n, times in code_times.items():
        print(f"code_execution on the task's 48 solutions, --reward-num-workers {n}: {median_and_range(times)}")
    print(f"one sandboxed program: {median_and_range(sandbox)}; exec() in this process: "
          f"{statistics.median(in_process) * 1e6:.0f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", help="write the code task to this .jsonl file, and exit")
    options = parser.parse_args()
    if options.write:
        with open(options.write, "w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows()))
    else:
        speed()
