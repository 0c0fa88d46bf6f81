#!/usr/bin/env bash
# docs/ppo_continuous.md's table and figure: ppo_continuous.py at 1M steps, 3 seeds each on HalfCheetah-v5, Hopper-v5
# and Walker2d-v5, two runs at a time (one per core, about 10 minutes per run alone here). Writes TensorBoard runs to
# benchmarks/runs/, then prints the table and draws the curves.
#   bash benchmarks/ppo_continuous.sh             # the defaults (exp name ppo_continuous)
#   bash benchmarks/ppo_continuous.sh cleanrl     # CleanRL's settings (exp name ppo_continuous_cleanrl)
#   bash benchmarks/ppo_continuous.sh defaults HalfCheetah-v5     # some of the envs only (then no figure)
# CleanRL's ppo_continuous_action.py has the same network and hyperparameters but starts at std 1 (log-std 0) and
# treats a time-limit truncation as a termination; "cleanrl" runs this script with those two settings.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-defaults}" in
  defaults) FLAGS="" ;;
  cleanrl) FLAGS="--log-std-init 0 --no-bootstrap-truncation --exp-name ppo_continuous_cleanrl" ;;
  *) echo "usage: bash benchmarks/ppo_continuous.sh [defaults|cleanrl] [ENV_ID ...]" >&2; exit 2 ;;
esac
ALL="HalfCheetah-v5 Hopper-v5 Walker2d-v5"
ENVS="${*:2}"
for seed in 1 2 3; do
  for env_id in ${ENVS:-$ALL}; do
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 python ../ppo_continuous.py --env-id "$env_id" --seed "$seed" $FLAGS > /dev/null 2>&1 &
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do sleep 2; done
  done
done
wait
python summarize.py ppo runs
if [ -z "$ENVS" ]; then (cd .. && python benchmarks/plot_curves.py); fi  # a figure with every panel, or none
