#!/usr/bin/env bash
# The PPO paper's Table 1 on discrete tasks: no constraint, clipping, adaptive KL, fixed-β KL, all else equal,
# in a regime where unconstrained updates overshoot (lr 1e-3 without annealing, 10 epochs; the defaults are
# 2.5e-4 annealed, 4 epochs). 8 variants × 2 envs × 3 seeds, 200k steps each, JOBS runs at a time (default 2).
# Writes TensorBoard runs to benchmarks/trust_region/runs/, then prints the table and draws the figure.
#   bash benchmarks/ppo_trust_region.sh
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p trust_region && cd trust_region
REGIME="--learning-rate 1e-3 --no-anneal-lr --update-epochs 10 --total-timesteps 200000 --eval-episodes 10"
VARIANTS=("ppo_kl.py --no-adaptive-kl --kl-beta 0 --exp-name tr_none"
          "ppo_clip.py --exp-name tr_clip"
          "ppo_kl.py --kl-target 0.003 --exp-name tr_adaptive_0.003"
          "ppo_kl.py --kl-target 0.01 --exp-name tr_adaptive_0.01"
          "ppo_kl.py --kl-target 0.03 --exp-name tr_adaptive_0.03"
          "ppo_kl.py --no-adaptive-kl --kl-beta 0.3 --exp-name tr_fixed_0.3"
          "ppo_kl.py --no-adaptive-kl --kl-beta 1 --exp-name tr_fixed_1"
          "ppo_kl.py --no-adaptive-kl --kl-beta 3 --exp-name tr_fixed_3")
for seed in 1 2 3; do
  for env_id in CartPole-v1 Acrobot-v1; do
    for variant in "${VARIANTS[@]}"; do
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 python ../../$variant --env-id "$env_id" --seed "$seed" $REGIME > /dev/null &
      while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-2}" ]; do sleep 1; done
    done
  done
done
wait
cd ../.. && python benchmarks/ppo_trust_region.py benchmarks/trust_region/runs docs/curves/trust_region.svg
