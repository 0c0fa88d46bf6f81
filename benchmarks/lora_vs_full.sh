#!/usr/bin/env bash
# LoRA against full fine-tuning on the built-in task, one seed each: dpo.py, rlhf_ppo.py and grpo.py at their
# defaults, then with --lora-r 16 --lora-alpha 32 at 10x the learning rate (LoRA's usual ratio), from the same
# SFT and reward models. Wall time and peak resident memory (GNU time's %M) of each run, then the table.
# Run it on an otherwise idle machine: the times are part of what it measures.
#   bash benchmarks/lora_vs_full.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/lora_vs_full
mkdir -p "$out"
run() {  # name, then the command's arguments
  local name=$1; shift
  /usr/bin/time -f "%e %M" -o "$out/$name.time" python "$@" > "$out/$name.log" 2>&1
  echo "$name: $(cut -d' ' -f1 "$out/$name.time") s, $(( $(cut -d' ' -f2 "$out/$name.time") / 1024 )) MiB peak"
}
run sft sft.py
run reward_model reward_model.py
run dpo dpo.py --exp-name dpo_full --output-dir models/dpo_full
run dpo_lora dpo.py --exp-name dpo_lora --output-dir models/dpo_lora --lora-r 16 --lora-alpha 32 --lr 1e-3
run rlhf_ppo rlhf_ppo.py --exp-name rlhf_ppo_full --output-dir models/rlhf_ppo_full
run rlhf_ppo_lora rlhf_ppo.py --exp-name rlhf_ppo_lora --output-dir models/rlhf_ppo_lora --lora-r 16 --lora-alpha 32 --lr 1.5e-3
run grpo grpo.py --exp-name grpo_full --output-dir models/grpo_full
run grpo_lora grpo.py --exp-name grpo_lora --output-dir models/grpo_lora --lora-r 16 --lora-alpha 32 --lr 1e-3
python benchmarks/summarize_lora.py runs "$out"
