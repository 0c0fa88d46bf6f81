#!/usr/bin/env bash
# docs/scaling.md's table of scale/grpo.py against TRL's GRPOTrainer on one GPU, side by side: a random Qwen2 of
# Qwen2.5-0.5B's shape (benchmarks/random_qwen.py: prompts of about 200 tokens), 256 completions per rollout (32
# prompts × 8) of 128 new tokens, minibatches of 64 in micro-batches of 16, μ = 2, β = 0.04, exact match as the
# reward, bfloat16 autocast over float32 weights on both sides, ITERATIONS rollouts (default 3). PAIRS alternating
# pairs (default 3), each run with --profile: completions/s of the loop, generation tokens/s, and where the loop's
# time goes.
#   TRL_PYTHON=python3 bash benchmarks/gpu_rollout.sh [PAIRS]     # TRL 1.16 importable by TRL_PYTHON
set -euo pipefail
PAIRS=${1:-3}; PY=${PYTHON:-python}; N=${ITERATIONS:-3}; ROOT=$(pwd); work=$(mktemp -d)
export PYTHONUNBUFFERED=1
$PY benchmarks/random_qwen.py "$work"
ours="$PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/grpo.py --model-name-or-path $work/base --dataset-name $work/prompts.jsonl
    --reward-fn exact_match --num-iterations $N --response-length 128 --max-prompt-length 512 --batch-size 256
    --generation-batch-size 256 --mini-batch-size 64 --gradient-accumulation-steps 4 --eval-every 1000 --eval-size 16
    --bf16 --output-dir $work/out --profile"
trl="$TRL_PYTHON $ROOT/benchmarks/trl_grpo.py --gpu --model-name-or-path $work/base --dataset-name $work/prompts.jsonl
    --num-iterations $N --response-length 128 --batch-size 256 --mini-batch-size 64 --micro-batch-size 16 --profile"
cd "$work"
echo "## grpo.py against TRL $($TRL_PYTHON -c 'import trl; print(trl.__version__)')'s GRPOTrainer on $($PY -c 'import torch; print(torch.cuda.get_device_name())')"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "TRL=$(echo $trl)" "grpo.py=$(echo $ours)"
