#!/usr/bin/env bash
# The RLHF pipeline on the built-in task with every default, timed, then the README table.
# Run it on an otherwise idle machine: the times are part of what it measures.
#   bash benchmarks/rlhf_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for cmd in "sft.py" "reward_model.py" "rlhf_ppo.py" "dpo.py" \
           "rlhf_ppo.py --kl-coef 0 --exp-name rlhf_ppo_kl0 --output-dir models/rlhf_ppo_kl0"; do
  start=$(date +%s)
  python $cmd > "benchmarks/$(echo "$cmd" | tr ' /' '__').log"
  echo "python $cmd: $(( $(date +%s) - start )) s"
done
python benchmarks/summarize_rlhf.py runs
