#!/usr/bin/env bash
# Benchmarks of ppo_continuous.py at 1M steps: 3 seeds on HalfCheetah-v5 and Hopper-v5 with defaults,
# 3 on Hopper-v5 with --log-std-init 0, then two one-seed ablations on HalfCheetah; two runs at a time
# (one per core), about 10 minutes each here.
#   bash benchmarks/continuous.sh
set -euo pipefail
cd "$(dirname "$0")"
jobs_list=()
for seed in 1 2 3; do jobs_list+=("--env-id HalfCheetah-v5 --seed $seed" "--env-id Hopper-v5 --seed $seed"); done
for seed in 1 2 3; do jobs_list+=("--env-id Hopper-v5 --seed $seed --log-std-init 0 --exp-name ppo_continuous_logstd0"); done
jobs_list+=("--env-id HalfCheetah-v5 --seed 1 --log-std-init 0 --exp-name ppo_continuous_logstd0"
            "--env-id HalfCheetah-v5 --seed 1 --no-bootstrap-truncation --exp-name ppo_continuous_nobootstrap")
for job in "${jobs_list[@]}"; do
  # shellcheck disable=SC2086
  python ../ppo_continuous.py $job > /dev/null 2>&1 &
  while [ "$(jobs -rp | wc -l)" -ge 2 ]; do sleep 2; done
done
wait
python summarize.py runs
