#!/usr/bin/env bash
# docs/ppo_clip.md's and ppo_kl.md's results: ppo_clip.py and ppo_kl.py, 3 seeds each, two runs at a time (one per
# core). Writes TensorBoard runs to benchmarks/runs/, then prints the tables and draws the curves and β's figure.
#   bash benchmarks/ppo_discrete.sh
# With `trust-region`, docs/ppo_kl.md's trust-region table instead, the PPO paper's Table 1 on discrete tasks:
# no constraint, clipping, adaptive KL, fixed-β KL, all else equal, in a regime where unconstrained updates
# overshoot (lr 1e-3 without annealing, 10 epochs: ppo_kl.py's defaults; ppo_clip.py's are 2.5e-4 annealed, 4
# epochs). 3 variants × 2 envs × 5 seeds, 200k steps each, JOBS runs at a time (default 2). Writes TensorBoard runs to benchmarks/trust_region/runs/, then prints
# the table (mean and 95% interval over seeds) and draws the figure.
#   bash benchmarks/ppo_discrete.sh trust-region     # SEEDS="1 2 3 4 5" by default
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = trust-region ]; then
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
  exit 0
fi
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
