#!/usr/bin/env bash
# The figures of docs/sft.md, reward_model.md, rlhf_ppo.md, dpo.md and grpo.md (the built-in task, every default):
# the pipeline in order, each run timed, then the one table of all of them (benchmarks/summarize.py rlhf).
# Run it on an otherwise idle machine (the times are part of what it measures); about 15 minutes on 2 CPU cores.
#   bash benchmarks/rlhf_pipeline.sh
# `kto`: docs/kto.md's table, after the pipeline's sft.py and reward_model.py: for each of SEEDS (1 2 3), kto.py on the
# unpaired halves of the pairs, dpo.py on the pairs, kto.py at 1:4 undesirable:desirable with the paper's
# --undesirable-weight and with the default, kto.py at TRL's β; JOBS at once (2), one thread each; then summarize.py kto.
#   bash benchmarks/rlhf_pipeline.sh kto
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = kto ]; then
  out=benchmarks/kto && mkdir -p $out
  for seed in ${SEEDS:-1 2 3}; do
    for run in "kto kto.py" "dpo dpo.py" "kto_1to4 kto.py --undesirable-fraction 0.2 --undesirable-weight 3" \
               "kto_1to4_w1 kto.py --undesirable-fraction 0.2" "kto_beta0.1 kto.py --beta 0.1"; do
      set -- $run && name=$1 && shift
      while [ "$(jobs -r | wc -l)" -ge "${JOBS:-2}" ]; do sleep 5; done
      ( start=$(date +%s)
        OMP_NUM_THREADS=1 python "$@" --seed $seed --exp-name $name --output-dir $out/models/${name}_s$seed --no-progress \
          > $out/${name}_$seed.log 2>&1
        echo "$name $seed $(( $(date +%s) - start ))" >> $out/times.txt
        mv runs/${name}__${name}_s${seed}__* $out/ ) &
    done
  done
  wait
  exec python benchmarks/summarize.py kto $out docs/curves/kto.svg
fi
mkdir -p runs/pipeline_logs
for cmd in "sft.py" "reward_model.py" "rlhf_ppo.py" "dpo.py" "grpo.py" \
           "rlhf_ppo.py --kl-coef 0 --exp-name rlhf_ppo_kl0 --output-dir models/rlhf_ppo_kl0" \
           "grpo.py --reward-model-path models/reward_model --exp-name grpo_rm --output-dir models/grpo_rm"; do
  start=$(date +%s)
  python $cmd > "runs/pipeline_logs/$(echo "$cmd" | tr ' /' '__').log"  # runs/: beside the TensorBoard runs
  echo "python $cmd: $(( $(date +%s) - start )) s"
done
python benchmarks/summarize.py rlhf runs
