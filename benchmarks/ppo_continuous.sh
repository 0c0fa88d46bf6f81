#!/usr/bin/env bash
# Benchmarks of ppo_continuous.py at 1M steps: 3 seeds each on HalfCheetah-v5, Hopper-v5 and Walker2d-v5
# with the defaults, two runs at a time (one per core, about 10 minutes per run alone here). Writes
# TensorBoard runs to benchmarks/runs/, then prints the README table and draws the curves.
#   bash benchmarks/ppo_continuous.sh
set -euo pipefail
cd "$(dirname "$0")"
for seed in 1 2 3; do
  for env_id in HalfCheetah-v5 Hopper-v5 Walker2d-v5; do
    OMP_NUM_THREADS=1 python ../ppo_continuous.py --env-id "$env_id" --seed "$seed" > /dev/null 2>&1 &
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do sleep 2; done
  done
done
wait
python summarize_ppo.py runs
(cd .. && python benchmarks/plot_curves.py)
