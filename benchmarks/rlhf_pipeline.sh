#!/usr/bin/env bash
# The figures of docs/sft.md, reward_model.md, rlhf_ppo.md, dpo.md and grpo.md (the built-in task, every default):
# the pipeline in order, each run timed, then the one table of all of them (benchmarks/summarize.py rlhf).
# Run it on an otherwise idle machine (the times are part of what it measures); about 15 minutes on 2 CPU cores.
#   bash benchmarks/rlhf_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs/pipeline_logs
for cmd in "sft.py" "reward_model.py" "rlhf_ppo.py" "dpo.py" "grpo.py" \
           "rlhf_ppo.py --kl-coef 0 --exp-name rlhf_ppo_kl0 --output-dir models/rlhf_ppo_kl0" \
           "grpo.py --reward-model-path models/reward_model --exp-name grpo_rm --output-dir models/grpo_rm"; do
  start=$(date +%s)
  python $cmd > "runs/pipeline_logs/$(echo "$cmd" | tr ' /' '__').log"  # runs/: beside the TensorBoard runs
  echo "python $cmd: $(( $(date +%s) - start )) s"
done
python benchmarks/summarize.py rlhf runs
