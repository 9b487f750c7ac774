#!/usr/bin/env bash
# The quality study (docs/quality.md) on the GPU machine, as one background job that outlives the
# device calls (each call is limited to 10 minutes; the machine keeps its disk while it is warm):
#   bash scripts/quality_gpu.sh start BUDGET_S [STEPS]   corpus, then `python -m msa_train.quality all` in the background
#   bash scripts/quality_gpu.sh wait SECONDS             wait for it up to SECONDS, then pack what exists into $OUT
# Each `wait` leaves $OUT/quality.tgz (summary.json, plots, every run's metrics, the log), so the
# results of finished runs come back even if a later call never happens.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the carried wheels, PYTHONPATH
W=${QUALITY_WORK:-/tmp/quality}
mkdir -p "$W"
case ${1:-} in
  start)
    steps=${3:+--steps $3}
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$W/gpu.txt"
    setsid nohup bash -c "set -o pipefail; python3 -m msa_train.quality corpus --out $W/corpus --max-tokens ${MAX_TOKENS:-40000000} \
        --vocab 16384 && python3 -m msa_train.quality all --work $W --out $W/results --budget-s $2 $steps; echo \$? > $W/rc" \
      > "$W/log" 2>&1 < /dev/null &
    echo "started; budget $2 s" ;;
  wait)
    end=$((SECONDS + $2))
    while [ ! -f "$W/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    [ -f "$W/rc" ] && echo "finished: rc=$(cat "$W/rc")" || echo "still running"
    (cd "$W" && tar czf "$OUT/quality.tgz" --ignore-failed-read gpu.txt log rc state.json results data/mix.json \
       corpus/manifest.json runs/*/metrics.jsonl runs/*/summary.json runs/*/nsa_distill.json runs/*/config.yaml 2>/dev/null)
    grep -v "^\s*$" "$W/log" | grep -vi "warn" | tail -40 ;;
  *) echo "usage: $0 start BUDGET_S [STEPS] | wait SECONDS" >&2; exit 2 ;;
esac
