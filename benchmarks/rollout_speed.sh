#!/bin/bash
# Rollout speed, side by side at one thread each: grpo.py against TRL's GRPOTrainer, and grpo.py and rlhf_ppo.py
# against a checkout from before the fast rollouts. docs/rollout_speed.md has the results and how to make TRL's
# virtual environment.
#   TRL_PYTHON=/path/to/trl_venv/bin/python bash benchmarks/rollout_speed.sh BEFORE_CHECKOUT [PAIRS] [--profile]
# Run from the repo root after `python sft.py && python reward_model.py`, alone on an idle machine.
set -euo pipefail
BEFORE=$(realpath "$1"); PAIRS=${2:-3}; PROFILE=${3:-}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python}; ROOT=$(pwd); SCRATCH=$(mktemp -d)
FLAGS="--sft-model-path $ROOT/models/sft --num-iterations 10 --eval-every 1000 --eval-size 64 --output-dir $SCRATCH/out"
PPO="--reward-model-path $ROOT/models/reward_model"
cd "$SCRATCH"
echo "## grpo.py against TRL $($TRL_PYTHON -c 'import trl; print(trl.__version__)')'s GRPOTrainer"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" \
    "TRL=$TRL_PYTHON $ROOT/benchmarks/trl_grpo.py --sft-model-path $ROOT/models/sft --num-iterations 10 $PROFILE" \
    "grpo.py=$PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/grpo.py $FLAGS $PROFILE"
echo "## grpo.py before and after"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "before=$PY $ROOT/benchmarks/rollout_timer.py $BEFORE/grpo.py $FLAGS $PROFILE" \
    "after=$PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/grpo.py $FLAGS $PROFILE"
echo "## rlhf_ppo.py before and after"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "before=$PY $ROOT/benchmarks/rollout_timer.py $BEFORE/rlhf_ppo.py $FLAGS $PPO $PROFILE" \
    "after=$PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/rlhf_ppo.py $FLAGS $PPO $PROFILE"
