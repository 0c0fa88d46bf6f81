"""The held-out task of grpo.py's variants study, fixed before any tuning run: word problems in GSM8K's format
as benchmarks/make_arithmetic.py writes them, but made by a generator of their own, with another operation and
other lengths: each subtracts a smaller number from a two-digit one ("... gives away ... How many are left?"),
in other sentences, names and items, and one problem in four takes two steps (a − b − c), so that answers run
to 35 bytes (the arithmetic task's to 23; arithmetic.sh samples 40 tokens here, 24 there). The recipe is chosen
on the arithmetic task and judged here; nothing here was tuned on.

    python benchmarks/make_heldout.py --out data/heldout/gsm8k_format.jsonl --num-rows 6000 --seed 1
    TASK=heldout bash benchmarks/arithmetic.sh      # its SFT model and runs, trained as the arithmetic task's
"""
import argparse
import json
import os
import random

NAMES = ["Iris", "Jon", "Kai", "Lena", "Milo", "Nora", "Omar", "Pia"]
ITEMS = ["marbles", "stickers", "stamps", "tickets", "beads", "shells"]
ONE_STEP = ["{name} had {a} {item} and gave {b} to a friend. How many {item} are left?",
            "There were {a} {item} in a box. {name} took {b} out. How many {item} are still in the box?"]
TWO_STEPS = ["{name} had {a} {item}, lost {b} on Monday and {c} on Tuesday. How many {item} are left?"]


def problem(rng):
    """One word problem and its GSM8K-style answer: the work, then `#### <number>`."""
    name, item, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(20, 99)
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
    parser.add_argument("--out", default="data/heldout/gsm8k_format.jsonl")
    parser.add_argument("--num-rows", type=int, default=6000, help="the scripts hold out the first tenth (at most "
                        "--eval-size rows) as their eval set")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(problem(rng)) + "\n" for _ in range(args.num_rows))
    print(f"wrote {args.num_rows} rows to {args.out}")


if __name__ == "__main__":
    main()
