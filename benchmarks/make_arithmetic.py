"""The two generated tasks of docs/grpo.md's variants tables, in GSM8K's format, one JSON object a line,
{"question": ..., "answer": "<work>\\n#### <number>"}, the answer's work first and the number after `####` last.
benchmarks/arithmetic.sh maps them to the scripts' columns (question -> prompt; answer -> completion for sft.py,
-> target for grpo.py and rlhf_ppo.py).

- arithmetic: word problems that add two numbers in [1, --max-term].
- heldout: fixed before any tuning run, a generator of its own with another operation and other lengths: each
  subtracts a smaller number from a two-digit one, in other sentences, names and items, and one problem in four
  takes two steps (a − b − c), so that answers run to 35 bytes (the arithmetic task's to 23). The recipe is chosen
  on the arithmetic task and judged here; nothing was tuned on it.

    python benchmarks/make_arithmetic.py --out data/arithmetic/gsm8k_format.jsonl --num-rows 6000 --seed 1
    python benchmarks/make_arithmetic.py --task heldout --out data/heldout/gsm8k_format.jsonl --seed 1
"""
import argparse
import json
import os
import random

NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "cards", "pens", "shells"]
TEMPLATES = ["{name} has {a} {item} and gets {b} more. How many {item} now?",
             "{name} had {a} {item} and found {b} more. How many {item} in all?"]


def problem(rng, max_term):
    """One word problem and its GSM8K-style answer."""
    a, b = rng.randint(1, max_term), rng.randint(1, max_term)
    question = rng.choice(TEMPLATES).format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return {"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
HELDOUT_NAMES = ["Iris", "Jon", "Kai", "Lena", "Milo", "Nora", "Omar", "Pia"]
HELDOUT_ITEMS = ["marbles", "stickers", "stamps", "tickets", "beads", "shells"]
ONE_STEP = ["{name} had {a} {item} and gave {b} to a friend. How many {item} are left?",
            "There were {a} {item} in a box. {name} took {b} out. How many {item} are still in the box?"]
TWO_STEPS = ["{name} had {a} {item}, lost {b} on Monday and {c} on Tuesday. How many {item} are left?"]


def heldout_problem(rng):
    """One problem of the held-out task and its GSM8K-style answer: the work, then `#### <number>`."""
    name, item, a = rng.choice(HELDOUT_NAMES), rng.choice(HELDOUT_ITEMS), rng.randint(20, 99)
    if rng.random() < 0.25:
        b = rng.randint(1, a // 2)
        c = rng.randint(1, a - b - 1)
        question = rng.choice(TWO_STEPS).format(name=name, item=item, a=a, b=b, c=c)
        return {"question": question, "answer": f"{a} - {b} = {a - b}, {a - b} - {c} = {a - b - c}\n#### {a - b - c}"}
    b = rng.randint(1, a - 1)
    question = rng.choice(ONE_STEP).format(name=name, item=item, a=a, b=b)
    return {"question": question, "answer": f"{a} - {b} = {a - b}\n#### {a - b}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/arithmetic/gsm8k_format.jsonl")
    parser.add_argument("--num-rows", type=int, default=6000, help="the scripts hold out a tenth at most (--eval-size "
                        "rows), drawn at random with --seed, as their eval set")
    parser.add_argument("--max-term", type=int, default=50, help="each term is uniform in [1, max-term]")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--task", choices=("arithmetic", "heldout"), default="arithmetic")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        make = (lambda: problem(rng, args.max_term)) if args.task == "arithmetic" else (lambda: heldout_problem(rng))
        f.writelines(json.dumps(make()) + "\n" for _ in range(args.num_rows))
    print(f"wrote {args.num_rows} rows to {args.out}")


if __name__ == "__main__":
    main()
