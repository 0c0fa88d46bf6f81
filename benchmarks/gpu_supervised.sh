#!/usr/bin/env bash
# docs/scaling.md's table of the supervised scripts on one GPU:
# scale/sft.py, scale/reward_model.py and scale/dpo.py against TRL's SFTTrainer, RewardTrainer and DPOTrainer
# (benchmarks/trl_supervised.py), side by side on one GPU, alternating: benchmarks/random_qwen.py's random Qwen2 of
# Qwen2.5-0.5B's shape and its data (rows of about 250 tokens), BATCH samples or pairs per step (default 8) in one
# micro-batch, --max-length 1024, STEPS steps (default 40), lr 1e-5 after 1 warmup step, bf16 autocast over
# float32 weights on both sides (float32 on a machine without CUDA), PAIRS pairs per script (default 2). Each side
# reports samples per second of its training loop, loading and evaluation excluded (the scripts'
# charts/samples_per_second, read by benchmarks/gpu_step.py, which adds the peak CUDA memory).
#   TRL_PYTHON=python3 bash benchmarks/gpu_supervised.sh [PAIRS]   # TRL 1.16 importable by TRL_PYTHON
# SCRIPTS="sft dpo" runs some of the three (SCRIPTS=kto: kto.py against KTOTrainer, docs/kto.md's CPU figure); OURS_FLAGS adds flags to our side (--compile); SCALE=DIR takes DIR/sft.py
# and the others instead of scale/'s (an earlier commit's, for PROFILE_STEPS before and after); DATA=DIR takes
# DIR/base, DIR/sft.jsonl and DIR/pref.jsonl instead of making them (`python benchmarks/random_qwen.py DIR --tiny`:
# a tiny model, to try the commands on the CPU).
# Both sides also report the steady speed, after the first WARMUP_STEPS steps (default 10; benchmarks/step_clock.py),
# which a real run's thousands of steps see; the tables give both. PROFILE_STEPS=N runs each side once with a profile of N
# steps after the warmup instead of the pairs (the GPU's busy fraction, kernels per step, the longest kernels).
# Each script's pairs start with an untimed run of the first side (UNTIMED_FIRST=1 of benchmarks/rollout_speed.py;
# UNTIMED_FIRST=0 to skip it): on one H100, TRL's two runs that came first after an idle GPU were the slow ones.
set -euo pipefail
PAIRS=${1:-2}; PY=${PYTHON:-python}; B=${BATCH:-8}; S=${STEPS:-40}; ROOT=$(pwd); TRL_PYTHON=${TRL_PYTHON:-$PY}
export PYTHONUNBUFFERED=1
work=${DATA:-$(mktemp -d)}
[ -n "${DATA:-}" ] || $PY benchmarks/random_qwen.py "$work"
if [ "$($PY -c 'import torch; print(torch.cuda.is_available())')" = True ]; then
  ours_precision="--bf16"; trl_precision="--gpu"; device=$($PY -c 'import torch; print(torch.cuda.get_device_name())')
else
  ours_precision="--no-cuda --no-bf16"; trl_precision=""; device="the CPU ($(nproc) cores)"
fi
out=$(mktemp -d); cd "$out"  # runs/ of our side go here
for name in ${SCRIPTS:-sft reward_model dpo}; do
  data=pref.jsonl; extra=""
  [ "$name" = sft ] && data=sft.jsonl
  [ "$name" = dpo ] && extra="--reward-model-path None --beta 0.5"
  script=${SCALE:-$ROOT/scale}/$name.py
  [ "$name" = kto ] && extra="--reward-model-path None --beta 0.5" && script=$ROOT/kto.py  # top-level only
  ours="$PY $ROOT/benchmarks/gpu_step.py $script --model-name-or-path $work/base
      --dataset-name $work/$data
      --max-length 1024 --batch-size $B --max-steps $S --lr 1e-5 --warmup-steps 1 --eval-every 100000 --eval-size 16
      $ours_precision --output-dir $out/$name $extra ${OURS_FLAGS:-}"
  trl="$TRL_PYTHON $ROOT/benchmarks/trl_supervised.py $name --model $work/base --dataset $work/$data --max-length 1024
      --batch-size $B --max-steps $S --lr 1e-5 --warmup-steps 1 $trl_precision"
  echo "## ${script#$ROOT/} against TRL $($TRL_PYTHON -c 'import trl; print(trl.__version__)') on $device, batch $B, $S steps"
  set -- "TRL=$(echo $trl)" "${script#$ROOT/}=$(echo $ours)"
  if [ -n "${PROFILE_STEPS:-}" ]; then
    for side in "$@"; do
      echo "### ${side%%=*}"
      log=$(${side#*=} 2>&1) || { echo "$log" | tail -20; exit 1; }
      echo "$log" | grep '^{' | tail -1
    done
  else
    UNTIMED_FIRST=${UNTIMED_FIRST:-1} $PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "$@"
  fi
  echo
done
