#!/usr/bin/env bash
# docs/distill.md's speed comparison: distill.py against TRL 1.16's DistillationTrainer (benchmarks/trl_distill.py,
# run by TRL_PYTHON, the python of TRL's own virtual environment) on the CPU, the same student, teacher and settings:
# ITERATIONS (100) batches of 64 completions, β = 1, no evaluation, one thread each (OMP_NUM_THREADS=1), PAIRS (5)
# alternating pairs, one process at a time, the whole process timed. Needs benchmarks/distill.sh's models (OUT,
# default benchmarks/distill: the student of seed 1 and the teacher). Prints one line per run and each pair's ratio.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/benchmarks/distill}
models="--model-name-or-path $out/student_s1 --teacher-model-name-or-path $out/teacher"
iterations=${ITERATIONS:-100}
export OMP_NUM_THREADS=1
cd "$(mktemp -d)"
for pair in $(seq "${PAIRS:-5}"); do
  for side in ours trl; do  # TRL second in odd pairs, first in even ones
    [ $((pair % 2)) = 0 ] && side=$([ "$side" = ours ] && echo trl || echo ours)
    start=$(date +%s.%N)
    if [ "$side" = ours ]; then
      python "$root/distill.py" $models --num-iterations "$iterations" --eval-size 0 --output-dir distill > ours.log 2>&1
    else
      "${TRL_PYTHON:?set TRL_PYTHON to the python of the virtual environment TRL is installed in}" "$root/benchmarks/trl_distill.py" \
        $models --num-iterations "$iterations" > trl.log 2>&1
    fi
    seconds=$(echo "$(date +%s.%N) - $start" | bc)
    echo "pair $pair $side $seconds"
    eval "$side=$seconds"
  done
  echo "pair $pair TRL / distill.py: $(echo "scale=3; $trl / $ours" | bc)"
done
