"""Rewards and tools that hang, crash or run the model's code. The reward functions' calls (call_reward: timed, and
split among worker processes with --reward-num-workers), their failures counted and a run stopped only by
--max-reward-failures in a row; agent_grpo.py's --tools in a worker killed at --tool-timeout, its memory bounded;
and the sandbox of --reward-fn code_execution against hostile completions, each stopped by the limit it names
(docs/grpo.md has the table). The helpers are one text in grpo.py, rlhf_ppo.py and agent_grpo.py (and scale/'s
in its two files: tests/test_copies.py), so grpo's are called here."""
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import TINY_LM, read_scalars, run_script

import agent_grpo as ag
import grpo


def guard_of(functions, timeout=120.0, max_failures=3, workers=0):
    """The RewardGuard of {name: fn}, with `workers` worker processes (0: calls in this process)."""
    return grpo.RewardGuard(list(functions), timeout, max_failures, [grpo.Worker(functions) for _ in range(workers)])


def flaky(prompts, completions, **columns):
    """Raises on a batch holding "bad"; sleeps on one holding "slow"; else each completion's length."""
    if "bad" in completions:
        raise ValueError("a bad completion\nsecond line")
    if "slow" in completions:
        time.sleep(30)
    return [float(len(c)) for c in completions]


def test_a_call_that_raises_or_times_out_gives_none_and_is_counted(capsys):
    """In the trainer (no worker): the whole batch is one call, so a raise or a timeout gives every completion None;
    the completions are counted by kind, the first failure said once, and counts() reads and resets them."""
    guard = guard_of({"flaky": flaky}, timeout=0.3)
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 3, ["ab", "c", "def"], {}) == [2.0, 1.0, 3.0]
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 3, ["ab", "bad", "c"], {}) == [None] * 3
    start = time.monotonic()
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 2, ["slow", "c"], {}) == [None] * 2
    assert time.monotonic() - start < 2  # stopped at 0.3 s, not after its 30 s sleep
    assert guard.counts() == {"rewards/flaky_timeouts": 2.0, "rewards/flaky_errors": 3.0}
    assert guard.counts() == {"rewards/flaky_timeouts": 0.0, "rewards/flaky_errors": 0.0}
    said = capsys.readouterr().out.splitlines()
    assert said == ["note: reward function 'flaky' raised ValueError: a bad completion on 3 of 3 completion(s): None "
                    "(not scored), counted in rewards/flaky_errors; the run goes on (said once)"]


def test_max_reward_failures_in_a_row_stops_the_run_and_a_success_resets_the_count():
    guard = guard_of({"flaky": flaky}, max_failures=2)
    grpo.call_reward(guard, "flaky", flaky, ["p"], ["bad"], {})
    grpo.call_reward(guard, "flaky", flaky, ["p"], ["ok"], {})  # a success: the count starts again
    grpo.call_reward(guard, "flaky", flaky, ["p"], ["bad"], {})
    with pytest.raises(SystemExit) as stop:
        grpo.call_reward(guard, "flaky", flaky, ["p"], ["bad"], {})
    assert str(stop.value.code) == ("error: reward function 'flaky' failed on every completion of 2 calls in a row "
                                    "(--max-reward-failures 2; its first failure: raised ValueError: a bad completion)"
                                    "; stopped, nothing saved")


def test_workers_split_the_batch_and_a_failed_part_costs_only_its_completions():
    """Two workers, the batch of 4 split in halves: the half that raises gets None, the other its values; a half that
    hangs is killed at the timeout with its worker, which is replaced, and the next call is whole again."""
    guard = guard_of({"flaky": flaky}, timeout=1.0, workers=2)
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 4, ["a", "bad", "ccc", "dd"], {}) == [None, None, 3.0, 2.0]
    first, second = (w.process.pid for w in guard.workers)
    start = time.monotonic()
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 4, ["a", "b", "slow", "dd"], {}) == [1.0, 1.0, None, None]
    assert time.monotonic() - start < 5
    assert guard.workers[0].process.pid == first and guard.workers[1].process.pid != second  # the hung one replaced
    assert not os.path.exists(f"/proc/{second}") or "zombie" in open(f"/proc/{second}/status").read().lower()
    assert guard.counts() == {"rewards/flaky_timeouts": 2.0, "rewards/flaky_errors": 2.0}
    assert grpo.call_reward(guard, "flaky", flaky, ["p"] * 4, ["a", "b", "ccc", "dd"], {}) == [1.0, 1.0, 3.0, 2.0]


def dies(prompts, completions, **columns):
    os._exit(3)


def test_a_worker_that_dies_is_an_error_and_is_replaced():
    guard = grpo.RewardGuard(["dies"], 5.0, 3, [grpo.Worker({"dies": dies, "flaky": flaky})])
    pid = guard.workers[0].process.pid
    assert grpo.call_reward(guard, "dies", dies, ["p"], ["a"], {}) == [None]
    assert guard.first["dies"] == "killed its worker process (exit code 3)" and guard.workers[0].process.pid != pid
    assert grpo.call_reward(guard, "flaky", flaky, ["p"], ["ab"], {}) == [2.0]


def spin(n: int) -> int:
    """Loops forever.

    Args:
        n: anything
    """
    while True:
        n += 1


def hog(gigabytes: int) -> int:
    """Allocates this many GB.

    Args:
        gigabytes: how many
    """
    return len(bytearray(gigabytes << 30))


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far (None where it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] == "Z" else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_tool_past_its_timeout_is_killed_not_left_spinning_and_one_that_allocates_without_end_fails():
    """agent_grpo.py's --tools run in a worker: a call that loops forever fails at --tool-timeout and its process is
    gone (the thread agent_grpo.py used to leave kept a core busy); one that allocates 8 GB fails with MemoryError at
    TOOL_MEMORY while the trainer goes on; the policy reads both as TRL's error results."""
    tools = {"spin": spin, "hog": hog, "multiply": ag.multiply}
    worker = ag.Worker(tools, ag.TOOL_MEMORY)
    pid = worker.process.pid
    assert ag.call_tool(tools, call("spin", n=1), 0.5, worker) == (str({"error": "timed out after 0.5 s"}), True)
    time.sleep(0.5)
    assert cpu_seconds(pid) is None and worker.process.pid != pid  # killed, and a fresh worker in its place
    assert ag.call_tool(tools, call("hog", gigabytes=8), 10.0, worker) == (str({"error": "MemoryError"}), True)
    assert ag.call_tool(tools, call("multiply", a=6, b=7), 1.0, worker) == ("42", False)
    assert ag.call_tool(tools, call("multiply", a=6), 1.0, worker)[1]  # a missing argument: the TypeError's text


# ---- the sandbox of --reward-fn code_execution -------------------------------------------------------
ROOT = os.getuid() == 0


@pytest.fixture
def sandbox(monkeypatch):
    """run_sandboxed with short limits (1 s of CPU, 3 s in all) so that each hostile program ends in seconds."""
    monkeypatch.setitem(grpo.SANDBOX_LIMITS, "RLIMIT_CPU", 1)
    monkeypatch.setattr(grpo, "SANDBOX_WALL_SECONDS", 3)
    python = grpo.sandbox_python()

    def run(program, asserts):
        start = time.monotonic()
        return grpo.run_sandboxed(python, program, asserts), time.monotonic() - start
    return run


def test_code_execution_by_hand(sandbox):
    """The fraction of the asserts that pass after the completion's last fenced block; 0 with no block or one that
    does not run; None for a row with no test."""
    good = "Here:\n```python\ndef f(x):\n    return x + 1\n```\nand a better one\n```py\ndef f(x):\n    return 2 * x\n```"
    tests = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]
    rewards = grpo.code_execution(None, [good, "no code", "```python\nraise ValueError\n```", good], [tests] * 3 + [[]])
    assert rewards == [2 / 3, 0.0, 0.0, None]
    assert grpo.last_python_block("```\nx = 1\n```") == "x = 1\n" and grpo.last_python_block("`x`") is None


def test_the_model_code_runs_as_nobody_with_no_environment_in_an_empty_directory(sandbox):
    """What the sandbox's program sees: uid nobody (where the trainer is root), an empty environment (PYTHON* and the
    trainer's own variables are not inherited), an empty directory of its own."""
    passed, _ = sandbox("import os\nuid, env, here = os.getuid(), dict(os.environ), os.listdir('.')",
                        [f"assert uid == {grpo.NOBODY if ROOT else os.getuid()}", "assert here == []",
                         "assert 'PATH' not in env and 'HOME' not in env"])
    assert passed == 3


def hostile(tmp_path):
    """(name, program, asserts, reward, what stops it): the hostile completions of docs/grpo.md's table."""
    secret, keep = tmp_path / "secret.txt", tmp_path / "keep.txt"
    return [
        ("an endless loop", "while True:\n    pass\n", ["assert True"], 0, "RLIMIT_CPU"),
        ("a sleep past the wall time", "import time\ntime.sleep(60)\n", ["assert True"], 0, "the wall-time kill"),
        ("40 processes", "import os, time\npids = []\nfor _ in range(40):\n    pid = os.fork()\n    if pid == 0:\n"
         "        time.sleep(3)\n        os._exit(0)\n    pids.append(pid)\n", ["assert len(pids) == 40"], 0,
         "RLIMIT_NPROC"),
        # an anonymous mapping is not touched, so only the address space stops it (bytearray's zeroing: the CPU time)
        ("a 2 GiB allocation", "import mmap\nx = mmap.mmap(-1, 2 << 30)\n", ["assert len(x) == 2 << 30"], 0,
         "RLIMIT_AS"),
        ("a 64 MiB file", "with open('big', 'wb') as f:\n    f.write(b'0' * (64 << 20))\n",
         ["import os\nassert os.path.getsize('big') == 64 << 20"], 0, "RLIMIT_FSIZE"),
        ("the trainer's environment variables", "import os\nvalue = os.environ.get('TRAINER_SECRET')\n",
         ["assert value == 'hunter2'"], 0, "env={}"),
        ("the trainer's files", f"value = open({str(secret)!r}).read()\n", ["assert value == 'hunter2'"], 0,
         "uid nobody"),
        ("deleting the trainer's files", f"import os\nos.remove({str(keep)!r})\n", ["assert True"], 0, "uid nobody"),
        ("sys.exit(0) before the asserts", "def f():\n    return 1\nimport sys\nsys.exit(0)\n", ["assert f() == 1"], 0,
         "no assert runs after a program that does not end"),
        ("os._exit(0) before the asserts", "def f():\n    return 1\nimport os\nos._exit(0)\n", ["assert f() == 1"], 0,
         "no assert runs after a program that does not end"),
        ("printing a pass", "import os, sys\nprint('pass 0')\nos.write(int(sys.argv[1]), b'forged pass 0\\n')\n",
         ["assert False"], 0, "the secret on each line of the count"),
        ("a huge stdout", "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * (1 << 20))\ndef f():\n"
         "    return 1\n", ["assert f() == 1"], 1, "stdout to /dev/null: its honest 1"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_a_hostile_completion_gets_its_honest_reward_and_leaves_the_trainer_untouched(case, sandbox, tmp_path,
                                                                                     monkeypatch):
    name, program, asserts, reward, limit = hostile(tmp_path)[case]
    if limit == "uid nobody" and not ROOT:
        pytest.skip("the trainer is not root: the program runs as the trainer's user (docs/grpo.md)")
    monkeypatch.setenv("TRAINER_SECRET", "hunter2")
    (tmp_path / "secret.txt").write_text("hunter2")
    os.chmod(tmp_path / "secret.txt", 0o600)
    (tmp_path / "keep.txt").write_text("keep")
    passed, seconds = sandbox(program, asserts)
    assert passed == reward * len(asserts), (name, limit)
    assert (tmp_path / "keep.txt").read_text() == "keep" and os.environ["TRAINER_SECRET"] == "hunter2"
    if limit == "RLIMIT_CPU":  # stopped by its CPU time (1 s here), well before the wall-time kill (3 s)
        assert seconds < 2.5, seconds
    if limit == "the wall-time kill":
        assert 2.5 < seconds < 6, seconds


def test_the_network_is_unreachable(sandbox):
    """A listener the test opens on 127.0.0.1: the program's connection fails (its network namespace has no
    interface up), and nothing reaches the listener."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    passed, _ = sandbox(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n",
                        ["assert True"])
    assert passed == 0
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_it_cannot_kill_the_trainers_processes(sandbox):
    """A process of the trainer's (a child it started): the program's kill fails (another user's process, and a
    PID namespace in which it is not seen), and it lives on."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        passed, _ = sandbox(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\nos.kill(os.getppid(), "
                            "signal.SIGKILL)\n", ["assert True"])
        assert passed == 0 and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_process_that_leaves_the_session_dies_with_the_sandbox(sandbox):
    """A child that calls setsid (out of the session the wall-time kill reaches) and would write a file later: it
    dies when the program's process ends (PID 1 of its namespace), so the file never appears."""
    marker = f"/tmp/escaped-{os.getpid()}-{time.monotonic_ns()}"
    program = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
               f"    open({marker!r}, 'w').write('out')\n    os._exit(0)\n")
    passed, _ = sandbox(program, ["assert True"])
    time.sleep(2.5)
    assert passed == 1 and not os.path.exists(marker)


def processes_in(directory):
    """The pids of the processes whose working directory lies under `directory`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(directory)):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_timeout_leaves_no_sandbox_running(sandbox, workers, monkeypatch):
    """code_execution on a program that sleeps, stopped by --reward-timeout (0.5 s) before the sandbox's own wall-time
    kill: in the trainer (SIGALRM interrupts the wait, and the sandbox is killed on the way out) and in a worker
    (killed with its group: the sandbox, in a session of its own, dies with it), no process of the sandbox is left."""
    root = f"/tmp/sandbox-test-{os.getpid()}-{workers}"
    os.makedirs(root, mode=0o755, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", root)
    python = grpo.sandbox_python()
    code = functools.partial(grpo.code_execution, python=python)
    guard = grpo.RewardGuard(["code"], 0.5, 3, [grpo.Worker({"code": code}) for _ in range(workers)])
    sleeper = "```python\nimport time\ntime.sleep(30)\n```"
    assert grpo.call_reward(guard, "code", code, ["p"], [sleeper], {"tests": [["assert True"]]}) == [None]
    time.sleep(0.5)
    assert processes_in(root) == []
    os.rmdir(root) if not os.listdir(root) else None


# ---- end to end ---------------------------------------------------------------------------------------
HANGING_AND_RAISING = '''import time

calls = {"hang": 0, "flaky": 0}


def hang(prompts, completions, **columns):
    """Hangs on every other call (a network call that never answers)."""
    calls["hang"] += 1
    if calls["hang"] % 2 == 0:
        time.sleep(3600)
    return [0.5] * len(completions)


def flaky(prompts, completions, **columns):
    """Raises on every other call (one odd row)."""
    calls["flaky"] += 1
    if calls["flaky"] % 2 == 1:
        raise KeyError("an odd row")
    return [1.0] * len(completions)
'''


@pytest.mark.slow
@pytest.mark.parametrize("script,workers", [("grpo.py", "0"), ("grpo.py", "2"), ("rlhf_ppo.py", "2"),
                                            ("scale/grpo.py", "2"), ("scale/rlhf_ppo.py", "0")])
def test_a_hanging_and_a_raising_reward_function_do_not_stop_the_run(tiny_checkpoints, tmp_path, script, workers):
    """A reward function that hangs on every other call and one that raises on every other call, in the trainer and
    in 2 workers, in each script that takes --reward-fn (both tiers): the run finishes and saves, each failure said
    once and counted in its tag."""
    (tmp_path / "rewards.py").write_text(HANGING_AND_RAISING)
    rlhf = "rlhf_ppo" in script
    proc = run_script(script, "--model-name-or-path", str(tiny_checkpoints["sft"]), "--reward-fn", "rewards.py:hang",
                      "--reward-fn", "rewards.py:flaky", "--reward-timeout", "1", "--reward-num-workers", workers,
                      "--num-iterations", "3", "--batch-size", "8", "--mini-batch-size", "8", "--eval-every", "1",
                      "--eval-size", "4", "--no-progress", "--output-dir", "models/out",
                      *(["--reward-model-path", "None"] if rlhf else ["--num-generations", "4"]), cwd=tmp_path)
    out = proc.stdout
    assert "note: reward function 'flaky' raised KeyError: 'an odd row' on" in out
    assert "note: reward function 'hang' timed out after --reward-timeout 1 s on" in out
    assert (tmp_path / "models" / "out" / "config.json").exists()
    scalars = read_scalars(str(next((tmp_path / "runs").iterdir())))
    timeouts, errors = ([v for _, v in scalars[f"rewards/{n}"]] for n in ("hang_timeouts", "flaky_errors"))
    assert sum(timeouts) > 0 and sum(errors) > 0 and len(timeouts) == 3, (timeouts, errors)


@pytest.mark.slow
def test_grpo_runs_on_the_code_task_with_code_execution_in_two_workers(tmp_path):
    """benchmarks/code_rewards.py's 48 prompts (TRL's prompt and tests columns, and a solution for sft.py), a tiny
    model of sft.py's (a few steps: no learning is claimed), then two iterations of grpo.py with --reward-fn
    code_execution --reward-num-workers 2: the sandbox said, the reward, its timeouts and errors logged."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "code_rewards.py"), "--write", "code.jsonl"],
                   cwd=tmp_path, check=True)
    run_script("sft.py", "--dataset-name", "code.jsonl", *TINY_LM, "--max-steps", "4", "--eval-every", "4",
               "--eval-size", "8", "--batch-size", "8", "--warmup-steps", "0", "--output-dir", "models/sft",
               cwd=tmp_path)
    proc = run_script("grpo.py", "--dataset-name", "code.jsonl", "--reward-fn", "code_execution",
                      "--reward-num-workers", "2", "--response-length", "24", "--num-iterations", "2", "--batch-size",
                      "8", "--num-generations", "4", "--mini-batch-size", "8", "--eval-every", "2", "--eval-size", "4",
                      "--no-progress", cwd=tmp_path)
    assert "code_execution: the model's code runs in" in proc.stdout
    scalars = read_scalars(str(next((tmp_path / "runs").glob("grpo__*"))))
    for tag in ("rewards/code_execution_timeouts", "rewards/code_execution_errors", "objective/reward"):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag


def test_an_unbounded_reward_flag_is_one_line(tmp_path, monkeypatch):
    import tyro

    monkeypatch.chdir(tmp_path)
    for flags, words in ((["--reward-timeout", "0"], "--reward-timeout 0.0: it must be a finite number of seconds"),
                         (["--reward-num-workers", "-1"], "--reward-num-workers -1: it must be 0 or more"),
                         (["--max-reward-failures", "0"], "--max-reward-failures 0: it must be 1 or more")):
        for module in (grpo, ag):
            with pytest.raises(SystemExit) as stop:
                module.main(tyro.cli(module.Args, args=flags))
            assert str(stop.value.code).startswith(f"error: {words}"), stop.value.code
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
