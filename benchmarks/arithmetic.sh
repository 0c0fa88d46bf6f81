#!/usr/bin/env bash
# The data and SFT models of docs/grpo.md's variants tables (ONLY_SFT=1, which benchmarks/grpo_variants.sh starts
# from), or the arithmetic task end to end on the CPU: a GSM8K-format file (benchmarks/make_arithmetic.py), mapped to
# the scripts' columns; sft.py; then grpo.py and rlhf_ppo.py with the numeric reward, each from that SFT model.
# Writes each run's log and wall time to $OUT (benchmarks/arithmetic). SEED=2 for another seed; TASK=heldout for the
# held-out task (to benchmarks/heldout); SFT_STEPS: sft.py's --max-steps (750).
#   ONLY_SFT=1 bash benchmarks/arithmetic.sh && TASK=heldout ONLY_SFT=1 bash benchmarks/arithmetic.sh
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${SEED:-1}
task=${TASK:-arithmetic}
out=${OUT:-benchmarks/$task}/seed$seed
mkdir -p "$out"
response_length=24  # the longest answer and its EOS: 24 bytes (ByT5's tokens) on the arithmetic task, 36 held out
if [ "$task" = heldout ]; then
    python benchmarks/make_arithmetic.py --task heldout --out "$out/gsm8k_format.jsonl" --num-rows 6000 --seed "$seed"
    response_length=40
else
    python benchmarks/make_arithmetic.py --out "$out/gsm8k_format.jsonl" --num-rows 6000 --seed "$seed"
fi
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(line) for line in open(f"{out}/gsm8k_format.jsonl")]
with open(f"{out}/sft.jsonl", "w") as f:  # question -> prompt, answer -> completion (after a space)
    f.writelines(json.dumps({"prompt": r["question"], "completion": " " + r["answer"]}) + "\n" for r in rows)
with open(f"{out}/rl.jsonl", "w") as f:  # question -> prompt, answer -> target (numeric_match reads its #### number)
    f.writelines(json.dumps({"prompt": r["question"], "target": r["answer"]}) + "\n" for r in rows)
PY
timed() {  # name, command...: run it, its output to $out/<name>.log, its wall time to $out/times.txt
    local name=$1 start
    shift
    start=$(date +%s)
    "$@" > "$out/$name.log" 2>&1
    echo "$name $(( $(date +%s) - start ))" >> "$out/times.txt"
}
rm -f "$out/times.txt"
timed sft python sft.py --dataset-name "$out/sft.jsonl" --max-length 128 --max-steps "${SFT_STEPS:-750}" \
    --eval-every 250 --seed "$seed" --exp-name "arith_sft" --output-dir "$out/sft"
[ -z "${ONLY_SFT:-}" ] || exit 0
rl=(--model-name-or-path "$out/sft" --dataset-name "$out/rl.jsonl" --reward-fn numeric_match --max-prompt-length 96
    --response-length "$response_length" --seed "$seed")
timed grpo python grpo.py "${rl[@]}" --exp-name "arith_grpo" --output-dir "$out/grpo"
timed rlhf_ppo python rlhf_ppo.py "${rl[@]}" --kl-coef 0.05 --missing-eos-penalty -1 --exp-name "arith_rlhf_ppo" \
    --output-dir "$out/rlhf_ppo"
cat "$out/times.txt"
