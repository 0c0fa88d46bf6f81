#!/usr/bin/env bash
# docs/grpo.md's off-policy table and figure: scale/grpo.py (or scale/rlhf_ppo.py: the off-policy machinery is scale/'s
# alone) on the built-in task with rollouts sampled by
# the weights of K iterations before (--rollout-lag K), with no correction, token-level truncation (TIS) or
# sequence-level masking (TRL's default), each run from models/sft (`python sft.py` first), every other flag at
# its default, one thread each. SCRIPT (grpo), LAGS ("0 2 8"), CORRECTIONS ("none token_truncate sequence_mask"),
# SEEDS ("1 2 3") and JOBS (2 at once) pick the runs; EXTRA is added to every command. Logs and TensorBoard runs go
# to $OUT/<script> (default benchmarks/off_policy), wall times to its times.txt; then
#   python benchmarks/summarize.py off_policy benchmarks/off_policy/grpo
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
script=${SCRIPT:-grpo}
out=$(mkdir -p "${OUT:-$root/benchmarks/off_policy}/$script" && cd "${OUT:-$root/benchmarks/off_policy}/$script" && pwd)

run_one() {  # LAG CORRECTION SEED
  local lag=$1 correction=$2 seed=$3 name="K$1_$2_s$3" flags start
  case $correction in
    none) flags="--no-vllm-importance-sampling-correction" ;;
    token_truncate|token_mask|sequence_truncate|sequence_mask)
      flags="--vllm-importance-sampling-correction --vllm-importance-sampling-mode $correction" ;;
    opsm) flags="--no-vllm-importance-sampling-correction --off-policy-mask-threshold 0.5" ;;  # DeepSeek-V3.2's alone
    *) echo "unknown correction $correction" >&2; exit 1 ;;
  esac
  [ "$script" = rlhf_ppo ] && flags="$flags --reward-model-path $root/models/reward_model"
  cd "$out"
  start=$(date +%s)
  if OMP_NUM_THREADS=1 python "$root/scale/$script.py" --model-name-or-path "$root/models/sft" --rollout-lag "$lag" $flags \
       --seed "$seed" ${EXTRA:-} --exp-name "$name" --output-dir "/tmp/off_policy/$script/$name" > "$name.log" 2>&1; then
    echo "$lag $correction $seed $(( $(date +%s) - start ))" >> times.txt
  else
    echo "$lag $correction $seed failed" >> times.txt
  fi
  rm -rf "/tmp/off_policy/$script/$name"
}
export -f run_one
export root out script

for seed in ${SEEDS:-1 2 3}; do for lag in ${LAGS:-8 2 0}; do for correction in ${CORRECTIONS:-none token_truncate sequence_mask}; do
  echo "$lag $correction $seed"
done; done; done | xargs -P "${JOBS:-2}" -L 1 bash -c 'run_one "$@"' _
