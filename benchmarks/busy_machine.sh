#!/usr/bin/env bash
# The README quickstart's thread figures: `python sft.py`'s wall time for STEPS steps (default 100, no evaluation) on
# an idle machine, beside one busy process (a Python loop) at equal priority, and at a lower priority than it
# (`nice -n 5`, as a background job runs), once for each set of flags given ("" for the defaults):
#   bash benchmarks/busy_machine.sh "" "--threads 2"
# Run it on an otherwise idle machine; each line is one set of flags: idle, equal and lower seconds.
set -euo pipefail
STEPS=${STEPS:-100}; ROOT=$(cd "$(dirname "$0")/.." && pwd); out=$(mktemp -d); cd "$out"
run() {  # run [nice -n 5] FLAGS: seconds of one run
  local start; start=$(date +%s.%N)
  "${@:1:$#-1}" python "$ROOT/sft.py" --max-steps "$STEPS" --eval-size 0 --output-dir "$out/model" ${!#} > run.log 2>&1 ||
    { tail -3 run.log >&2; exit 1; }
  python -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)"
}
echo "| flags | idle (s) | beside a busy process (s) | niced beside it (s) |"
echo "|-|-|-|-|"
for flags in "$@"; do
  idle=$(run "$flags")
  python -c 'while True: pass' & busy=$!
  equal=$(run "$flags"); lower=$(run nice -n 5 "$flags")
  kill $busy
  echo "| \`python sft.py ${flags}\` | $idle | $equal | $lower |"
done
