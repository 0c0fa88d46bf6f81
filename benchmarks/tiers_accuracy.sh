#!/usr/bin/env bash
# Gold accuracy at the defaults on the built-in task (512 held-out prompts), one checkout's LM scripts, seeds 1-3:
# sft.py from scratch; reward_model.py (seed 1), dpo.py, grpo.py and rlhf_ppo.py from one SFT model and one reward
# model given to every run, so that both checkouts start from the same models. Run it for two checkouts, then
# summarize_tiers.py:
#   git worktree add /tmp/before aee7bdc
#   OMP_NUM_THREADS=1 bash benchmarks/tiers_accuracy.sh /tmp/before benchmarks/tiers/before MODELS &
#   OMP_NUM_THREADS=1 bash benchmarks/tiers_accuracy.sh . benchmarks/tiers/after MODELS &
#   python benchmarks/summarize_tiers.py benchmarks/tiers/before benchmarks/tiers/after
# MODELS: a directory holding models/sft and models/reward_model (made once, by the checkout before, seed 1).
set -euo pipefail
ROOT=$(cd "$1" && pwd)
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
MODELS=$(cd "$3" && pwd)/models
run() {  # run SCRIPT SEED FLAGS...: one run in OUT, its output in OUT/<script>_<seed>.log
  local script=$1 seed=$2 start
  shift 2
  start=$(date +%s)
  (cd "$OUT" && python "$ROOT/$script" --seed "$seed" "$@" > "${script%.py}_$seed.log" 2>&1)
  echo "$script seed $seed: $(( $(date +%s) - start )) s"
}
for seed in ${SEEDS:-1 2 3}; do
  run sft.py "$seed" --output-dir "models/sft_$seed"
  if [ "$seed" = 1 ]; then
    run reward_model.py "$seed" --model-name-or-path "$MODELS/sft" --output-dir "models/reward_model_$seed"
  fi
  run dpo.py "$seed" --model-name-or-path "$MODELS/sft" --reward-model-path "$MODELS/reward_model" \
    --output-dir "models/dpo_$seed"
  run grpo.py "$seed" --sft-model-path "$MODELS/sft" --output-dir "models/grpo_$seed"
  run rlhf_ppo.py "$seed" --sft-model-path "$MODELS/sft" --reward-model-path "$MODELS/reward_model" \
    --output-dir "models/rlhf_ppo_$seed"
done
