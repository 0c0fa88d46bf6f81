#!/usr/bin/env bash
# docs/ppo_kl.md's trust-region table, the PPO paper's Table 1 on discrete tasks: no constraint, clipping, adaptive
# KL, fixed-β KL, all else equal, in a regime where unconstrained updates overshoot (lr 1e-3 without annealing, 10
# epochs: ppo_kl.py's defaults; ppo_clip.py's are 2.5e-4 annealed, 4 epochs). 3 variants × 2 envs × 5 seeds, 200k
# steps each, JOBS runs at a time (default 2). Writes TensorBoard runs to benchmarks/trust_region/runs/, then prints
# the table (mean and 95% interval over seeds) and draws the figure.
#   bash benchmarks/ppo_trust_region.sh              # SEEDS="1 2 3 4 5" by default
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p trust_region && cd trust_region
REGIME="--learning-rate 1e-3 --no-anneal-lr --update-epochs 10 --total-timesteps 200000 --eval-episodes 10"
VARIANTS=("ppo_kl.py --no-adaptive-kl --kl-beta 0 --exp-name tr_none"
          "ppo_clip.py --exp-name tr_clip"
          "ppo_kl.py --kl-target 0.01 --kl-beta 1 --exp-name tr_adaptive_0.01")
# more variants of the paper's table, e.g.: "ppo_kl.py --no-adaptive-kl --kl-beta 1 --exp-name tr_fixed_1"
for seed in ${SEEDS:-1 2 3 4 5}; do
  for env_id in CartPole-v1 Acrobot-v1; do
    for variant in "${VARIANTS[@]}"; do
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 python ../../$variant --env-id "$env_id" --seed "$seed" $REGIME > /dev/null &
      while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-2}" ]; do sleep 1; done
    done
  done
done
wait
cd ../.. && python benchmarks/summarize.py trust_region benchmarks/trust_region/runs docs/curves/trust_region.svg
