"""The sizes a reader meets, held by test so that a feature pays for its room by moving or cutting, not by raising a
number: each docs page and all of docs/, the files of benchmarks/ (each beside the figure it makes), and the length
of `main` and of its loop in every script that trains on rollouts (new ones too), and each top-level LM file's lines
and flags (the references: a variant goes to scale/, so a variant never raises them; a new capability of a script may,
by what it needs, said in its commit). The README's 3,200 words are
tests/test_readme.py's; the 10 parameters of a function are ruff's (pyproject.toml). Each check is also shown to
catch a budget broken by one: a word, a file, a line."""
import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE_WORDS, TESTS_PAGE_WORDS, DOCS_WORDS = 3500, 1500, 15000
BENCHMARK_FILES = 25
# (main, its loop) in lines: the one-device references, and scale/'s full programs
LOOP_LINES = {"top-level": (120, 60), "scale": (200, 90)}
# (lines, flags) of each top-level LM file, the one-device reference: what issue 96 left, rounded up by under 2%;
# agent_grpo.py's raised by issue 97's capability (--environment, TRL's parse, the treasure hunt): +270 lines, +1 flag;
# all seven by issue 98's (a user's own data: lengths settled on the data, its samples printed, the reward model's
# data checked, the warmup and run-name helpers): +15 to +70 lines, no flag; the three that take --reward-fn by issue
# 99's (reward calls timed and in worker processes, tools in a worker, code_execution's sandbox): +350 lines, +3 flags;
# kto.py new with issue 100 (dpo.py's plumbing and the unpaired data: the pairs' halves apart, their imbalance)
REFERENCE_SIZES = {"sft.py": (965, 26), "reward_model.py": (835, 23), "dpo.py": (1085, 28), "rlhf_ppo.py": (1780, 42),
                   "grpo.py": (1980, 46), "distill.py": (1115, 33), "agent_grpo.py": (2220, 42),
                   "kto.py": (1215, 30)}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def pages():
    return {os.path.relpath(p, ROOT): read(p) for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))}


def over_budget(texts):
    """The budgets that `texts` ({docs page: its text}) break, as lines that say by how much."""
    words = {page: len(text.split()) for page, text in texts.items()}
    broken = [f"{page}: {n} words > {TESTS_PAGE_WORDS if page.endswith('tests.md') else PAGE_WORDS}"
              for page, n in words.items() if n > (TESTS_PAGE_WORDS if page.endswith("tests.md") else PAGE_WORDS)]
    if sum(words.values()) > DOCS_WORDS:
        broken.append(f"docs/: {sum(words.values())} words > {DOCS_WORDS}")
    return broken


def test_every_docs_page_and_all_of_docs_within_their_words():
    assert over_budget(pages()) == []


def test_one_word_over_is_caught():
    texts = pages()
    room = DOCS_WORDS - sum(len(t.split()) for t in texts.values())
    texts["docs/grpo.md"] += " word" * (room + 1)
    assert over_budget(texts) == [f"docs/: {DOCS_WORDS + 1} words > {DOCS_WORDS}"]
    texts = pages()
    texts["docs/tests.md"] = "word " * (TESTS_PAGE_WORDS + 1)
    assert f"docs/tests.md: {TESTS_PAGE_WORDS + 1} words > {TESTS_PAGE_WORDS}" in over_budget(texts)


def uncited(files, texts):
    """The benchmarks/ files that no page of `texts` names."""
    return [name for name in files if not any(f"benchmarks/{name}" in text or f"`{name}`" in text
                                              for text in texts.values())]


def benchmark_files():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*")) if os.path.isfile(p))


def cited_in():
    return {**pages(), "README.md": read("README.md")}


def test_benchmarks_holds_at_most_25_files_each_named_by_a_page():
    files = benchmark_files()
    assert len(files) <= BENCHMARK_FILES, files
    assert uncited(files, cited_in()) == []


def test_an_uncited_file_is_caught():
    assert uncited(benchmark_files() + ["orphan.py"], cited_in()) == ["orphan.py"]


def rollout_scripts():
    """Every LM script, in both tiers, whose main loops over rollouts (`for iteration in range(`). The gymnasium PPO
    scripts keep CleanRL's loop, all inline (about 100 lines, as CleanRL's ppo.py), and are not held here."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "scale", "*.py"))):
        text = read(path)
        if re.search(r"\n    for iteration in range\(", text) and "\ndef main(" in text and "import gymnasium" not in text:
            found.append(os.path.relpath(path, ROOT))
    return found


def main_and_loop_lines(text):
    """(lines of main, lines of its longest `for` statement)."""
    main = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = max((s for s in main.body if isinstance(s, ast.For)), key=lambda s: s.end_lineno - s.lineno)
    return main.end_lineno - main.lineno + 1, loop.end_lineno - loop.lineno + 1


def too_long(script, text):
    main_budget, loop_budget = LOOP_LINES["scale" if script.startswith("scale/") else "top-level"]
    main, loop = main_and_loop_lines(text)
    return [f"{script}: {what} {n} lines > {budget}" for what, n, budget in
            (("main", main, main_budget), ("loop", loop, loop_budget)) if n > budget]


def test_the_rollout_scripts_are_the_rl_scripts_of_both_tiers():
    assert {"grpo.py", "rlhf_ppo.py", "distill.py", "scale/grpo.py", "scale/rlhf_ppo.py"} <= set(rollout_scripts())


@pytest.mark.parametrize("script", rollout_scripts())
def test_main_and_its_loop_within_their_lines(script):
    assert too_long(script, read(script)) == []


def test_one_line_over_is_caught():
    text = read("grpo.py")
    main, loop = main_and_loop_lines(text)
    budget = LOOP_LINES["top-level"][1]
    # lines added inside the loop, before its last step: the loop (and main) grow by exactly that many
    anchor = "        if iteration % args.eval_every == 0 or iteration == args.num_iterations:\n"
    grown = text.replace(anchor, "        pass\n" * (budget - loop + 1) + anchor, 1)
    assert main_and_loop_lines(grown)[1] == budget + 1
    assert f"grpo.py: loop {budget + 1} lines > {budget}" in too_long("grpo.py", grown)


def test_the_suite_size_is_stated_so_that_a_new_test_keeps_it_true():
    """The README and the docs say "about" how many tests and minutes, never an exact count of passed tests."""
    for name, text in cited_in().items():
        assert not re.search(r"\d[\d,]* passed", text) or name == "docs/scaling.md", name  # scaling: CUDA logs


def lines_and_flags(text):
    """(lines of the file, fields of its Args: its flags)."""
    args = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    return len(text.splitlines()), sum(isinstance(n, ast.AnnAssign) for n in args.body)


def too_big(script, text):
    (lines, flags), (line_budget, flag_budget) = lines_and_flags(text), REFERENCE_SIZES[script]
    return [f"{script}: {what} {n} > {budget}" for what, n, budget in
            (("lines", lines, line_budget), ("flags", flags, flag_budget)) if n > budget]


def test_every_top_level_lm_file_is_held():
    lm = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")) if "import gymnasium" not in read(os.path.basename(p))}
    assert lm == set(REFERENCE_SIZES)


@pytest.mark.parametrize("script", sorted(REFERENCE_SIZES))
def test_each_reference_within_its_lines_and_flags(script):
    assert too_big(script, read(script)) == []


def test_a_line_or_a_flag_too_many_is_caught():
    text = read("grpo.py")
    lines, flags = lines_and_flags(text)
    line_budget, flag_budget = REFERENCE_SIZES["grpo.py"]
    grown = text + "\n" * (line_budget - lines + 1)
    assert too_big("grpo.py", grown) == [f"grpo.py: lines {line_budget + 1} > {line_budget}"]
    anchor = "    seed: int = 1\n"
    more = anchor + "".join(f"    knob_{i}: float = 0.0\n    \"\"\"a variant's knob\"\"\"\n"
                            for i in range(flag_budget - flags + 1))
    assert f"grpo.py: flags {flag_budget + 1} > {flag_budget}" in too_big("grpo.py", text.replace(anchor, more, 1))
