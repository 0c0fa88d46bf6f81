#!/usr/bin/env bash
# scale/grpo.py sampling with its CUDA graph (sample_tokens_graphed) against the same script with the eager loop
# (rollout_timer.py --eager-sampling), side by side on one GPU, alternating: gpu_rollout.sh's random Qwen2 of
# Qwen2.5-0.5B's shape, data and settings (256 completions of 128 new tokens per rollout, bf16 autocast over float32
# weights), ITERATIONS rollouts per run (default 2), PAIRS pairs (default 1), each run with --profile.
#   bash benchmarks/gpu_sampling.sh [PAIRS]
set -euo pipefail
PAIRS=${1:-1}; PY=${PYTHON:-python}; N=${ITERATIONS:-2}; ROOT=$(pwd); work=$(mktemp -d)
export PYTHONUNBUFFERED=1
$PY benchmarks/random_qwen.py "$work"
ours="$PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/grpo.py --sft-model-path $work/base --dataset-name $work/prompts.jsonl
    --reward-fn exact_match --num-iterations $N --response-length 128 --max-prompt-length 512 --batch-size 256
    --generation-batch-size 256 --mini-batch-size 64 --gradient-accumulation-steps 4 --eval-every 1000 --eval-size 16
    --bf16 --output-dir $work/out --profile"
cd "$work"
echo "## scale/grpo.py, eager against graphed sampling, on $($PY -c 'import torch; print(torch.cuda.get_device_name())')"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "eager=$(echo $ours) --eager-sampling" "graphed=$(echo $ours)"
