#!/usr/bin/env bash
# scale/rlhf_ppo.py against the same program at an earlier commit (BEFORE_SCRIPT: its rlhf_ppo.py, e.g. aee7bdc's,
# from before the two tiers, when the top-level file was this program), side by side on one GPU, alternating:
# benchmarks/random_qwen.py's random Qwen2 of Qwen2.5-0.5B's shape as the policy, reference and value model, a
# reward model trained from it for 10 steps by scale/reward_model.py, its prompts of about 200 tokens, 256
# completions of 128 new tokens per rollout, minibatches of 64 in micro-batches of 16, 4 PPO epochs (the default),
# bf16 autocast over float32 weights, ITERATIONS rollouts per run (default 3), PAIRS pairs (default 3), each run
# with --profile (benchmarks/rollout_timer.py: completions/s of the loop and the seconds of its parts).
#   git show aee7bdc:rlhf_ppo.py > before/rlhf_ppo.py && bash benchmarks/gpu_rlhf_ppo.sh before/rlhf_ppo.py [PAIRS]
# DATA=DIR takes DIR/base, DIR/pref.jsonl and DIR/prompts.jsonl instead of making them, and BATCH and MINI_BATCH
# set the two sizes (a tiny model, to try the commands on the CPU); on a machine without CUDA both sides run in
# float32 on the CPU. CANDIDATES=a,b runs scale/rlhf_ppo.py (not the earlier commit's) with benchmarks/candidates.py's
# training-throughput candidates.
set -euo pipefail
BEFORE=$(realpath "$1"); PAIRS=${2:-3}; PY=${PYTHON:-python}; N=${ITERATIONS:-3}; ROOT=$(pwd)
B=${BATCH:-256}; MB=${MINI_BATCH:-64}
export PYTHONUNBUFFERED=1
work=${DATA:-$(mktemp -d)}
[ -n "${DATA:-}" ] || $PY benchmarks/random_qwen.py "$work"
precision="--bf16"; device=$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")')
[ -n "$device" ] || { precision="--no-cuda --no-bf16"; device="the CPU ($(nproc) cores)"; }
out=$(mktemp -d); cd "$out"
if ! $PY "$ROOT/scale/reward_model.py" --model-name-or-path "$work/base" --dataset-name "$work/pref.jsonl" --max-length 512 \
    --batch-size 8 --max-steps 10 --warmup-steps 1 --eval-every 10 --eval-size 16 $precision --output-dir "$out/rm" > rm.log 2>&1; then
  tail -20 rm.log; exit 1
fi
flags="--sft-model-path $work/base --reward-model-path $out/rm --dataset-name $work/prompts.jsonl --num-iterations $N
    --response-length 128 --max-prompt-length 512 --batch-size $B --mini-batch-size $MB --gradient-accumulation-steps 4
    --eval-every 1000 --eval-size 16 $precision --output-dir $out/policy --profile"
echo "## scale/rlhf_ppo.py against $1 on $device"
$PY "$ROOT/benchmarks/rollout_speed.py" "$PAIRS" "before=env CANDIDATES= $PY $ROOT/benchmarks/rollout_timer.py $BEFORE $(echo $flags)" \
    "scale/rlhf_ppo.py${CANDIDATES:+ with $CANDIDATES}=env CANDIDATES=${CANDIDATES:-} $PY $ROOT/benchmarks/rollout_timer.py $ROOT/scale/rlhf_ppo.py $(echo $flags)"
