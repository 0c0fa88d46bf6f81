"""A generated arithmetic task in GSM8K's format: word problems that add two numbers, one JSON object a
line, {"question": ..., "answer": "<a> + <b> = <sum>\\n#### <sum>"}, the answer's work first and the number
after `####` last, as in GSM8K. benchmarks/arithmetic.sh maps it to the scripts' columns, as the README's
grpo card spells out (question -> prompt; answer -> completion for sft.py, -> target for grpo.py and
rlhf_ppo.py).

    python benchmarks/make_arithmetic.py --out data/arithmetic/gsm8k_format.jsonl --num-rows 6000 --seed 1
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/arithmetic/gsm8k_format.jsonl")
    parser.add_argument("--num-rows", type=int, default=6000, help="the scripts hold out the first tenth (at most "
                        "--eval-size rows) as their eval set")
    parser.add_argument("--max-term", type=int, default=50, help="each term is uniform in [1, max-term]")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(problem(rng, args.max_term)) + "\n" for _ in range(args.num_rows))
    print(f"wrote {args.num_rows} rows to {args.out}")


if __name__ == "__main__":
    main()
