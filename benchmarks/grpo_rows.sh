#!/usr/bin/env bash
# grpo.py on the built-in task from models/sft (run sft.py and reward_model.py first): the default and the
# variants of the README, each timed, then the README tables. Run it on an otherwise idle machine.
#   bash benchmarks/grpo_rows.sh          (every variant, 3 seeds, three tasks: benchmarks/grpo_variants.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
for cmd in "grpo.py" \
           "grpo.py --reward-model-path models/reward_model --exp-name grpo_rm --output-dir models/grpo_rm" \
           "grpo.py --advantage rloo --exp-name rloo --output-dir models/rloo" \
           "grpo.py --no-scale-rewards --exp-name grpo_noscale --output-dir models/grpo_noscale" \
           "grpo.py --loss-type dapo --exp-name grpo_dapo --output-dir models/grpo_dapo" \
           "grpo.py --loss-type dr_grpo --no-scale-rewards --exp-name dr_grpo --output-dir models/dr_grpo"; do
  start=$(date +%s)
  python $cmd > "benchmarks/$(echo "$cmd" | tr ' /' '__').log"
  echo "python $cmd: $(( $(date +%s) - start )) s"
done
python benchmarks/summarize_grpo.py runs
