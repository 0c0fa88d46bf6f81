#!/usr/bin/env bash
# A --bf16 step and a --fsdp --bf16 step (torchrun, 1 rank) of every LM script on a random Qwen2 of
# Qwen2.5-0.5B's shape (24 layers, 896 wide, 151,936-token vocabulary: 494M parameters), with its wall time,
# peak torch.cuda.max_memory_allocated and logged throughput (benchmarks/gpu_step.py). Needs a GPU; writes
# JSON lines to $1. NO_FSDP=1 skips the --fsdp runs, FSDP_ONLY=1 the others.
#   bash benchmarks/gpu_steps.sh results.jsonl
set -euo pipefail
out=${1:-gpu_steps.jsonl}
work=$(mktemp -d)
python benchmarks/random_qwen.py "$work"  # the model and data
run() {  # run NAME CMD...: one JSON line, the script's last lines on failure
  if ! "$@" > "$work/log" 2>&1; then tail -20 "$work/log"; exit 1; fi
  grep '^{"script"' "$work/log" | tail -1 >> "$out"; tail -1 "$out"
}
common="--bf16 --exp-name gpu"
sft="--model-name-or-path $work/base --dataset-name $work/sft.jsonl --max-length 512 --batch-size 8 --max-steps 10 --warmup-steps 1 --eval-every 10 --eval-size 16"
rm_="--model-name-or-path $work/sft --dataset-name $work/pref.jsonl --max-length 512 --batch-size 8 --max-steps 10 --warmup-steps 1 --eval-every 10 --eval-size 16"
dpo="--model-name-or-path $work/sft --dataset-name $work/pref.jsonl --max-length 512 --batch-size 8 --max-steps 10 --warmup-steps 1 --eval-every 10 --eval-size 16 --reward-model-path None"
ppo="--sft-model-path $work/sft --reward-model-path $work/rm --dataset-name $work/prompts.jsonl --max-prompt-length 256 --response-length 128 --batch-size 32 --mini-batch-size 8 --num-iterations 2 --eval-every 2 --eval-size 16"
grpo="--sft-model-path $work/sft --dataset-name $work/prompts.jsonl --reward-fn exact_match --max-prompt-length 256 --response-length 128 --batch-size 32 --num-generations 8 --mini-batch-size 8 --num-iterations 2 --eval-every 2 --eval-size 16"
run python benchmarks/gpu_step.py scale/sft.py $sft $common --output-dir $work/sft
run python benchmarks/gpu_step.py scale/reward_model.py $rm_ $common --output-dir $work/rm
step() {  # step LAUNCH: a step of each script (FSDP: under torchrun)
  local extra=""; [ "$1" = python ] || extra="--fsdp"
  for name in ${SCRIPTS:-sft reward_model dpo rlhf_ppo grpo}; do
    local flags; case $name in sft) flags="$sft";; reward_model) flags="$rm_";; dpo) flags="$dpo";; rlhf_ppo) flags="$ppo";; grpo) flags="$grpo";; esac
    run $1 benchmarks/gpu_step.py scale/$name.py $flags $common $extra --output-dir $work/out-$name
  done
}
[ -n "${FSDP_ONLY:-}" ] || step python
[ -n "${NO_FSDP:-}" ] || step "torchrun --nproc-per-node 1"   # FSDP_ONLY=1 SCRIPTS="rlhf_ppo grpo" bash ...: those alone
