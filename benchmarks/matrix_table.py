"""The README's real-checkpoint matrix table, from the report the matrix test writes:

    LM_MATRIX_REPORT=/tmp/matrix.jsonl python -m pytest tests/test_real_models.py -k pipeline
    python benchmarks/matrix_table.py /tmp/matrix.jsonl
"""
import json
import sys


def main(path):
    rows = [json.loads(line) for line in open(path)]
    keys = [(r["arch"], r["dtype"]) for r in rows]
    if len(set(keys)) != len(keys):
        sys.exit(f"error: {path} holds more than one run of a cell; delete it and run the matrix once")
    print("| architecture | saved as | tokenizer | SFT data | preference data | prompts | PPO first-ratio error "
          "| SFT eval loss | RM eval loss | PPO policy / value loss | DPO eval loss | GRPO first-ratio error "
          "| GRPO eval score |")
    print("|-|-|-|-|-|-|-|-|-|-|-|-|-|")
    for r in rows:
        print(f"| {r['arch']} | {r['dtype']} | {r['tokenizer']} | {r['sft']} | {r['preference']} | {r['prompts']} "
              f"| {r['first_ratio_error']:.1f} | {r['sft_eval_loss']:.3f} | {r['rm_eval_loss']:.3f} "
              f"| {r['ppo_policy_loss']:.3f} / {r['ppo_value_loss']:.3f} | {r['dpo_eval_loss']:.3f} "
              f"| {r['grpo_first_ratio_error']:.1f} | {r['grpo_eval_score']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
