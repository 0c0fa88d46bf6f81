#!/usr/bin/env bash
# docs/ppo_clip.md's and ppo_kl.md's results: ppo_clip.py and ppo_kl.py, 3 seeds each, two runs at a time (one per
# core). Writes TensorBoard runs to benchmarks/runs/, then prints the tables and draws the curves and β's figure.
#   bash benchmarks/ppo_discrete.sh
set -euo pipefail
cd "$(dirname "$0")"
for job in "ppo_clip.py --env-id CartPole-v1" "ppo_clip.py --env-id Acrobot-v1" "ppo_kl.py --env-id CartPole-v1"; do
  for seed in 1 2 3; do
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 python ../$job --seed "$seed" > /dev/null &
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do sleep 1; done
  done
done
wait
# ppo_kl.py at ppo_clip.py's learning rate, schedule and epochs, where the penalty switches itself off (one seed)
python ../ppo_kl.py --env-id CartPole-v1 --learning-rate 2.5e-4 --anneal-lr --update-epochs 4 \
  --exp-name ppo_kl_clip_defaults --seed 1 > /dev/null
python summarize.py ppo runs --beta-figure ../docs/ppo_kl_beta.svg
(cd .. && python benchmarks/plot_curves.py)
