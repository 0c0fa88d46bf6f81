#!/usr/bin/env bash
# docs/distill.md's comparison of distillation and RL on one student. First the teacher (sft.py, then grpo.py, at
# their defaults) and, for each seed, the student (sft.py --n-layer 1 --n-embd 64); then from each student grpo.py
# at its defaults (120 rollouts of 256 completions) and distill.py with the sampled-token form, β = 1 and β = 0.5
# (480 batches of 64: as many completions sampled), every other flag at its default, one thread each, JOBS (2) at
# once; and --self-distill with each --teacher-context. SEEDS ("1 2 3") picks the seeds, ROWS (a regular expression)
# the rows of the second part. Models, logs and TensorBoard runs go to $OUT (default benchmarks/distill),
# each run's wall time to its times.txt; then
#   python benchmarks/summarize.py distill benchmarks/distill
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${OUT:-$root/benchmarks/distill}" && cd "${OUT:-$root/benchmarks/distill}" && pwd)

run_one() {  # NAME SCRIPT FLAGS...: one run in $out, its wall time to times.txt
  local name=$1 script=$2 start
  shift 2
  cd "$out"
  start=$(date +%s.%N)
  if OMP_NUM_THREADS=1 python "$root/$script.py" --exp-name "$name" --output-dir "$out/$name" "$@" > "$name.log" 2>&1
  then echo "$name $(echo "$(date +%s.%N) - $start" | bc)" >> times.txt
  else echo "$name failed" >> times.txt; fi
}
export -f run_one
export root out

# the teacher and the students
{ echo "teacher_sft sft"; for seed in ${SEEDS:-1 2 3}; do
    echo "student_s$seed sft --seed $seed --n-layer 1 --n-embd 64"; done
} | xargs -P "${JOBS:-2}" -L 1 bash -c 'run_one "$@"' _
run_one teacher grpo --model-name-or-path "$out/teacher_sft"

# RL and distillation from each student, the same prompts and as many completions sampled
for seed in ${SEEDS:-1 2 3}; do
  common="--seed $seed --model-name-or-path $out/student_s$seed"
  echo "grpo_s$seed grpo $common"
  echo "sampled_token_s$seed distill $common --teacher-model-name-or-path $out/teacher --sampled-token"
  echo "beta1_s$seed distill $common --teacher-model-name-or-path $out/teacher --beta 1"
  echo "beta0.5_s$seed distill $common --teacher-model-name-or-path $out/teacher --beta 0.5"
  # self-distillation: the student's own starting weights, given the target (OPSD, SDFT) or a sibling's success (SDPO)
  echo "self_answer_s$seed distill $common --self-distill --teacher-context answer"
  echo "self_success_s$seed distill $common --self-distill --teacher-context success --num-generations 8"
done | grep -E "${ROWS:-.}" | xargs -P "${JOBS:-2}" -L 1 bash -c 'run_one "$@"' _
