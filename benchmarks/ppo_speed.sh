#!/usr/bin/env bash
# Throughput of ppo_clip.py and ppo_continuous.py as a ratio to the usual single-file PPO, side by side:
# each pair runs one after the other, alternating, on an otherwise idle machine, with each program's own
# defaults (the same network sizes and hyperparameters). Prints each run's final steps/s and the ratios.
#   bash benchmarks/ppo_speed.sh BASELINE_DIR [REPEATS]
# BASELINE_DIR holds cleanrl_ppo.py and cleanrl_ppo_continuous_action.py: CleanRL's ppo.py and
# ppo_continuous_action.py ported to gymnasium 1.x (kept outside this repo; how to make them: docs/rl_notes.md).
# CartPole-v1 runs the default 500k steps; HalfCheetah-v5 102,400 steps (50 updates; its steps/s is flat after
# the first few) to keep the whole comparison near 12 minutes here.
set -euo pipefail
BASELINE=$(cd "$1" && pwd)
REPEATS=${2:-2}
REPO=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
cd "$out"  # the runs/ of these runs go to a scratch directory
sps_ours() { python "$@" --eval-episodes 0 --exp-name speed 2>/dev/null | grep -o 'SPS=[0-9]*' | tail -1 | cut -d= -f2; }
sps_base() { python "$@" 2>/dev/null | grep -o 'SPS: [0-9]*' | tail -1 | cut -d' ' -f2; }
for i in $(seq "$REPEATS"); do
  echo "CartPole-v1 ours $(sps_ours "$REPO/ppo_clip.py")" | tee -a log
  echo "CartPole-v1 cleanrl $(sps_base "$BASELINE/cleanrl_ppo.py")" | tee -a log
  echo "HalfCheetah-v5 ours $(sps_ours "$REPO/ppo_continuous.py" --total-timesteps 102400)" | tee -a log
  echo "HalfCheetah-v5 cleanrl $(sps_base "$BASELINE/cleanrl_ppo_continuous_action.py" --total-timesteps 102400)" | tee -a log
done
python - log <<'EOF'
import sys
from collections import defaultdict
sps = defaultdict(list)
for line in open(sys.argv[1]):
    env, who, value = line.split()
    sps[env, who].append(int(value))
for env in ("CartPole-v1", "HalfCheetah-v5"):
    ours, base = sps[env, "ours"], sps[env, "cleanrl"]
    print(f"{env}: ours {sum(ours) / len(ours):,.0f} steps/s {ours}, CleanRL port {sum(base) / len(base):,.0f} {base}: "
          f"{sum(ours) / sum(base) * len(base) / len(ours):.2f}x")
EOF
rm -rf "$out"
