#!/usr/bin/env bash
# Issue 37's `--preemption-mode`: swap against recompute on a KV pool too small for the
# requests in flight, the same trace through `pagoda bench serve`, one server after the other.
#
#   benchmarks/swap_vs_recompute.sh OUT_DIR [PAGODA_FLAGS...]
#   benchmarks/swap_vs_recompute.sh --model FILE.gguf OUT_DIR [PAGODA_FLAGS...]
#
# CONCURRENCY (16) requests of INPUT_LEN (256) tokens in, OUTPUT_LEN (512) out, NUM_REQUESTS
# (32) in all; the KV pool holds POOL_SHARE (1/3) of the tokens the requests in flight reach
# at full length, so running requests are preempted as they grow. recompute: a preempted
# request's blocks are freed and its prompt and output prefilled again when it resumes;
# swap: they move to the host tier (--kv-offload-memory, twice the pool) and are loaded back.
# Results: OUT_DIR/{recompute,swap}.json and .txt, the preemption and swap counters of each
# server (metrics-*.txt), compare.md (`pagoda bench compare`). Every run waits for the
# 1-minute load average to fall below 1.0 first (lib.sh's quiet).
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
if [ "${1:-}" = --model ]; then
  GGUF=${2:?usage: swap_vs_recompute.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
  shift 2
fi
OUT=${1:?usage: swap_vs_recompute.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
shift
FLAGS=("$@")
[ -f "$GGUF" ] || { echo "swap_vs_recompute.sh: no such model file: $GGUF" >&2; exit 2; }
mkdir -p "$OUT"
PORT=${PORT:-8776}
URL=http://127.0.0.1:$PORT
CONCURRENCY=${CONCURRENCY:-16} INPUT_LEN=${INPUT_LEN:-256} OUTPUT_LEN=${OUTPUT_LEN:-512}
NUM_REQUESTS=${NUM_REQUESTS:-32} POOL_SHARE=${POOL_SHARE:-3}

source "$(dirname "$0")/lib.sh"  # quiet, start_server
SERVER=
trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null || true' EXIT

read -r BYTES_PER_TOKEN _ < <($PY "$(dirname "$0")/kv_bytes_per_token.py" "$GGUF" auto)
IN_FLIGHT_TOKENS=$((CONCURRENCY * (INPUT_LEN + OUTPUT_LEN + 16)))
POOL_BYTES=$((IN_FLIGHT_TOKENS / POOL_SHARE * BYTES_PER_TOKEN))
HOST_BYTES=$((POOL_BYTES * 2))
tee "$OUT/arithmetic.txt" <<EOF
model: $GGUF ($BYTES_PER_TOKEN KV bytes per token)
$CONCURRENCY requests in flight x ($INPUT_LEN + $OUTPUT_LEN + 16) tokens = $IN_FLIGHT_TOKENS tokens at full length
KV pool: 1/$POOL_SHARE of them = $POOL_BYTES B (--kv-cache-memory); swap's host tier: $HOST_BYTES B
EOF

for mode in recompute swap; do
  extra=(--preemption-mode "$mode")
  [ "$mode" = swap ] && extra+=(--kv-offload-memory "$HOST_BYTES")
  start_server "$mode" --model "$GGUF" --kv-cache-memory "$POOL_BYTES" \
    --max-num-seqs "$CONCURRENCY" "${extra[@]}" "${FLAGS[@]}"
  quiet
  $PAGODA bench serve --base-url "$URL" --endpoint completions --dataset random \
    --num-requests "$NUM_REQUESTS" --max-concurrency "$CONCURRENCY" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --tokenizer "$GGUF" --seed 1 --no-progress --label "$mode" \
    --output "$OUT/$mode.json" | tee "$OUT/$mode.txt"
  curl -sf "$URL/metrics" | grep -E '^pagoda:(num_preemptions|kv_swap|kv_offload_swap)' \
    > "$OUT/metrics-$mode.txt" || true
  cat "$OUT/metrics-$mode.txt"
  kill -TERM $SERVER; wait $SERVER || true; SERVER=
done
$PAGODA bench compare "$OUT/recompute.json" "$OUT/swap.json" | tee "$OUT/compare.md"
