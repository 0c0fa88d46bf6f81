#!/usr/bin/env bash
# docs/ppo_clip.md's and ppo_continuous.md's speed tables: ppo_clip.py and ppo_continuous.py as a ratio to CleanRL's
# ppo.py and ppo_continuous_action.py, side by side: in each pair the programs run one after the other, alternating,
# on an otherwise idle machine, each with its own defaults (the same networks and hyperparameters), at the same torch
# thread count (1: ours --threads 1, CleanRL OMP_NUM_THREADS=1) and CleanRL also at its own default (torch's, one
# thread per core). Then the environment alone, stepped as the scripts step it with random actions: the limit a
# training loop cannot pass.
#   bash benchmarks/rl_speed.sh BASELINE_DIR [PAIRS]       # PAIRS=3 by default; 2.5 to 5 minutes a pair here (the speed varies between sessions)
# BASELINE_DIR holds cleanrl_ppo.py and cleanrl_ppo_continuous_action.py, CleanRL's files ported to gymnasium 1.x
# (kept outside this repo; how to make them: docs/ppo_clip.md). CartPole-v1 runs 102,400 steps (50 iterations),
# HalfCheetah-v5 40,960 (20 iterations): steps/s is each run's last SPS, over its whole loop.
set -euo pipefail
BASELINE=$(cd "$1" && pwd)
PAIRS=${2:-3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
cd "$out"  # the runs/ of these runs go to a scratch directory
ours() { OMP_NUM_THREADS=1 python "$@" --threads 1 --eval-episodes 0 --exp-name speed 2>/dev/null | grep -o 'SPS=[0-9]*' | tail -1 | cut -d= -f2; }
base() {  # base THREADS SCRIPT FLAGS...: THREADS 1, or "default" (no OMP_NUM_THREADS: torch's own choice)
  if [ "$1" = default ]; then env -u OMP_NUM_THREADS python "${@:2}"; else OMP_NUM_THREADS=$1 python "${@:2}"; fi 2>/dev/null |
    grep -o 'SPS: [0-9]*' | tail -1 | cut -d' ' -f2
}
for i in $(seq "$PAIRS"); do
  echo "CartPole-v1 ours-1 $(ours "$REPO/ppo_clip.py" --total-timesteps 102400)" | tee -a log
  echo "CartPole-v1 cleanrl-1 $(base 1 "$BASELINE/cleanrl_ppo.py" --total-timesteps 102400)" | tee -a log
  echo "CartPole-v1 cleanrl-default $(base default "$BASELINE/cleanrl_ppo.py" --total-timesteps 102400)" | tee -a log
  echo "HalfCheetah-v5 ours-1 $(ours "$REPO/ppo_continuous.py" --total-timesteps 40960)" | tee -a log
  echo "HalfCheetah-v5 cleanrl-1 $(base 1 "$BASELINE/cleanrl_ppo_continuous_action.py" --total-timesteps 40960)" | tee -a log
  echo "HalfCheetah-v5 cleanrl-default $(base default "$BASELINE/cleanrl_ppo_continuous_action.py" --total-timesteps 40960)" | tee -a log
done
for env_id in CartPole-v1 HalfCheetah-v5; do
  # the environment alone, stepped as the scripts step it (same-step autoreset, 4 envs for discrete actions, 1 for
  # Box ones), random actions drawn beforehand: no training loop can be faster
  echo "$env_id env-only $(OMP_NUM_THREADS=1 python - "$env_id" 2>/dev/null <<'PY'
import sys, time
import gymnasium as gym
env_id, steps = sys.argv[1], 40_960
num_envs = 4 if isinstance(gym.make(env_id).action_space, gym.spaces.Discrete) else 1
envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)],
                                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
envs.action_space.seed(0)
actions = [envs.action_space.sample() for _ in range(steps // num_envs)]
envs.reset(seed=0)
start = time.perf_counter()
for action in actions:
    envs.step(action)
print(f"{steps // num_envs * num_envs / (time.perf_counter() - start):.0f}")
PY
)" | tee -a log
done
python - log <<'PY'
import sys
from collections import defaultdict
import numpy as np
sps = defaultdict(list)
for line in open(sys.argv[1]):
    env, who, value = line.split()
    sps[env, who].append(float(value))
for env in ("CartPole-v1", "HalfCheetah-v5"):
    ours, limit = np.array(sps[env, "ours-1"]), sps[env, "env-only"][0]
    print(f"{env}: ours (1 thread) {', '.join(f'{v:,.0f}' for v in ours)} steps/s; the env alone {limit:,.0f} "
          f"(ours reaches {np.median(ours) / limit:.0%} of it)")
    for who, what in (("cleanrl-1", "equal threads (1)"), ("cleanrl-default", "each at its default (ours 1, CleanRL torch's)")):
        base = np.array(sps[env, who])
        ratios = ours / base
        print(f"  CleanRL {who}: {', '.join(f'{v:,.0f}' for v in base)} steps/s ({np.median(base) / limit:.0%} of the env "
              f"alone); ratio at {what}: pairs {', '.join(f'{r:.2f}x' for r in ratios)}, median {np.median(ratios):.2f}x, "
              f"range {ratios.min():.2f}-{ratios.max():.2f}x")
PY
rm -rf "$out"
