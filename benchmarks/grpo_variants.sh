#!/usr/bin/env bash
# docs/grpo.md's variants tables: GRPO's variants side by side: each one flag (or one paper's set of flags),
# everything else at the defaults, every run from the same SFT model. The reference's variants run grpo.py, the
# others (the 2026 losses, advantages and entropy controls) scale/grpo.py, which alone has them (script_of). Tasks:
#   builtin     the sort task, gold reward, from models/sft (`python sft.py` first)
#   arithmetic  benchmarks/arithmetic/seed1 (`ONLY_SFT=1 bash benchmarks/arithmetic.sh` first), numeric_match
#   heldout     benchmarks/heldout/seed1 (`TASK=heldout ONLY_SFT=1 bash benchmarks/arithmetic.sh` first)
# TASKS, VARIANTS and SEEDS pick the runs (all variants, seed 1 by default), JOBS how many run at once (1), each on
# one thread; EXTRA is added to every command (e.g. --no-cuda). Each run's log and TensorBoard run go to
# $OUT/<task> (default benchmarks/variants), its wall time to $OUT/<task>/times.txt; then
#   python benchmarks/summarize.py variants benchmarks/variants/arithmetic
# e.g. TASKS="builtin" SEEDS="1 2 3" JOBS=2 bash benchmarks/grpo_variants.sh
# SCRIPT=rlhf_ppo runs rlhf_ppo.py's variants instead (docs/rlhf_ppo.md's VC-PPO and VAPO table; RLHF_VARIANTS; VC-PPO
# and VAPO run scale/rlhf_ppo.py):
#   SCRIPT=rlhf_ppo SEEDS="1 2 3" JOBS=2 bash benchmarks/grpo_variants.sh      # after python reward_model.py
#   SCRIPT=rlhf_ppo TASKS=arithmetic VARIANTS="ppo_gold vcppo_gold vapo_gold" SEEDS="1 2 3" bash ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${OUT:-$root/benchmarks/variants}" && cd "${OUT:-$root/benchmarks/variants}" && pwd)
ALL="grpo dapo_loss dr_grpo rloo reinforce_pp reinforce_pp_baseline clip_higher gspo cispo mask_truncated
     soft_overlong dynamic_sampling dapo trl_defaults dppo dppo_kl maxrl scale_batch sapo luspo vespo two_terms gdpo
     entropy_coef adaptive_entropy top_entropy clip_cov kl_cov harsh harsh_entropy_coef harsh_adaptive_entropy
     harsh_top_entropy harsh_clip_cov harsh_kl_cov"
HARSH="--lr 1e-3 --beta 0"  # where the entropy collapses: 10x the step, no KL penalty
RLHF_VARIANTS="ppo_rm vcppo_rm vapo_rm ppo_gold vcppo_gold vapo_gold"
# VC-PPO: λ 1 for the critic, 0.95 for the actor, the critic warmed up; VAPO adds the length-adaptive λ (α 1: λ = 1 −
# 1/l, a horizon as long as the response; the paper's α 0.05 is for thousands of tokens and gives λ 0 here),
# clip-higher and, with a verifiable reward, the positive-example LM loss
VCPPO="--critic-lam 1.0 --actor-lam 0.95 --value-warmup-steps 5"
VAPO="--critic-lam 1.0 --length-adaptive-lam 1.0 --value-warmup-steps 5 --cliprange-high 0.28"

flags_of() {  # VARIANT RESPONSE_LENGTH: its flags; L_cache a fifth of the response length (DAPO: 4,096 of 20,480)
  local cache=$(( $2 / 5 ))
  case $1 in
    grpo) ;;                                                          # the defaults
    dapo_loss) echo "--loss-type dapo" ;;                             # every token weighs the same
    dr_grpo) echo "--loss-type dr_grpo --scale-rewards none" ;;       # Dr. GRPO
    rloo) echo "--advantage rloo" ;;
    reinforce_pp) echo "--advantage reinforce_pp" ;;
    reinforce_pp_baseline) echo "--advantage reinforce_pp_baseline" ;;
    clip_higher) echo "--epsilon-high 0.28" ;;                        # DAPO's clip-higher alone
    gspo) echo "--importance-sampling-level sequence --epsilon 3e-4 --epsilon-high 4e-4" ;;  # the GSPO paper's ε
    cispo) echo "--loss-type cispo --epsilon-high 5.0" ;;            # a wide cap on the weight, not tuned
    mask_truncated) echo "--mask-truncated-completions" ;;
    soft_overlong) echo "--soft-overlong-cache $cache" ;;
    dynamic_sampling) echo "--dynamic-sampling" ;;
    dapo) echo "--loss-type dapo --epsilon-high 0.28 --dynamic-sampling --soft-overlong-cache $cache --beta 0" ;;
    trl_defaults) echo "--loss-type dapo --beta 0" ;;                 # TRL's GRPOConfig defaults since 2025
    dppo) echo "--loss-type dppo" ;;                                  # binary TV, δ 0.2 (prime-rl's default)
    dppo_kl) echo "--loss-type dppo --dppo-divergence binary_kl --epsilon 0.05" ;;
    maxrl) echo "--advantage maxrl --missing-eos-penalty 0" ;;        # rewards must be ≥ 0
    scale_batch) echo "--scale-rewards batch" ;;
    sapo) echo "--loss-type sapo" ;;                                  # TRL's τ_pos 1, τ_neg 1.05
    luspo) echo "--loss-type luspo --importance-sampling-level sequence --epsilon 3e-4 --epsilon-high 4e-4" ;;
    vespo) echo "--loss-type vespo" ;;                                # TRL's k and λ
    two_terms) echo "$TERMS" ;;                                       # two reward terms, summed (GDPO's baseline)
    gdpo) echo "$TERMS --multi-objective-aggregation normalize_then_sum" ;;
    entropy_coef) echo "--entropy-coef 0.01" ;;                       # the entropy controls at the defaults,
    adaptive_entropy) echo "--use-adaptive-entropy" ;;                # where the entropy falls tenfold: TRL's
    top_entropy) echo "--top-entropy-quantile 0.2" ;;                 # target 0.2, step 0.005, from 0; the 80/20
    clip_cov) echo "--cov-method clip_cov" ;;                         # rule; the authors' r 2e-4 (bounds 1, 5)
    kl_cov) echo "--cov-method kl_cov" ;;                             # and k 2e-3 (β 1)
    harsh) echo "$HARSH" ;;
    harsh_*) echo "$HARSH $(flags_of "${1#harsh_}" "$2")" ;;          # the same at 10x the step, no KL
    ppo_rm) ;;                                                        # rlhf_ppo.py: the reward model's score
    vcppo_rm) echo "$VCPPO" ;;
    vapo_rm) echo "$VAPO" ;;                                          # (no pass to learn from: no LM loss)
    ppo_gold) echo "$GOLD" ;;                                         # the verifiable reward: gold, or
    vcppo_gold) echo "$GOLD $VCPPO" ;;                                # numeric_match on arithmetic
    vapo_gold) echo "$GOLD $VAPO --positive-lm-coef 0.1" ;;
    *) echo "unknown variant $1" >&2; exit 1 ;;
  esac
}

script_of() {  # VARIANT: the script that has it: the reference, or its scale/ sibling for the variants it alone has
  case ${1#harsh_} in
    dppo|dppo_kl|maxrl|scale_batch|sapo|luspo|vespo|gdpo|entropy_coef|adaptive_entropy|top_entropy|clip_cov|kl_cov)
      echo "scale/grpo" ;;
    vcppo_*|vapo_*) echo "scale/rlhf_ppo" ;;
    *) echo "${SCRIPT:-grpo}" ;;
  esac
}

run_one() {  # TASK VARIANT SEED
  local task=$1 variant=$2 seed=$3 start base
  case $task in
    builtin) base="--model-name-or-path ${SFT_BUILTIN:-$root/models/sft}"; length=12; GOLD="--reward-fn gold"
             TERMS="--reward-fn gold --reward-fn format --format-pattern \d{4,8}"  # the answer's form: 4-8 digits
             [[ $variant == *_rm ]] && base="$base --reward-model-path ${RM_BUILTIN:-$root/models/reward_model}" ;;
    arithmetic|heldout)
      local d=${DATA:-$root/benchmarks}/$task/seed1
      length=24; [ "$task" = heldout ] && length=40
      TERMS="--reward-fn format --format-pattern .+\n####\s\d+"  # with numeric_match: the GSM8K form too
      base="--model-name-or-path $d/sft --dataset-name $d/rl.jsonl --max-prompt-length 96 --response-length $length"
      GOLD=; [ "${SCRIPT:-grpo}" = grpo ] && base="$base --reward-fn numeric_match" || GOLD="--reward-fn numeric_match"
      ;;  # (no reward model here: rlhf_ppo's *_gold variants only)
    *) echo "unknown task $task" >&2; exit 1 ;;
  esac
  mkdir -p "$out/$task"
  cd "$out/$task"
  start=$(date +%s)
  if OMP_NUM_THREADS=1 python "$root/$(script_of "$variant").py" $base $(flags_of "$variant" $length) --seed "$seed" ${EXTRA:-} \
       --exp-name "${variant}_s$seed" --output-dir "/tmp/grpo_variants/$task/${variant}_s$seed" \
       > "${variant}_s$seed.log" 2>&1; then
    echo "$variant $seed $(( $(date +%s) - start ))" >> times.txt
  else
    echo "$variant $seed failed" >> times.txt
  fi
  rm -rf "/tmp/grpo_variants/$task/${variant}_s$seed"
}
export -f run_one flags_of script_of
export root out HARSH VCPPO VAPO

[ "${SCRIPT:-grpo}" = rlhf_ppo ] && ALL=$RLHF_VARIANTS
for task in ${TASKS:-builtin}; do for variant in ${VARIANTS:-$ALL}; do for seed in ${SEEDS:-1}; do
  echo "$task $variant $seed"
done; done; done | xargs -P "${JOBS:-1}" -L 1 bash -c 'run_one "$@"' _
