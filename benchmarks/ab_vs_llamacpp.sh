#!/usr/bin/env bash
# Issue 36's goal run: Pagoda against llama.cpp's llama-server on the bundled model, judged by
# `pagoda bench ab` on a captured multi-turn trace, and checked against separate
# `pagoda bench serve` runs of the same workload against each server (figures within 10%).
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/ab_vs_llamacpp.sh OUT_DIR
#
# 1. A Pagoda with --record-traffic gets a multi-turn workload from `bench serve` (16
#    conversations x 4 turns, 2 conversations/s): the captured trace.
# 2. A fresh Pagoda and llama-server (16 slots, 2 threads, as benchmarks/perf_suite.sh runs
#    it) start side by side.
# 3. `bench ab` replays the whole trace to each in turn (one block: the same load as the
#    capture), alternating, 6 times (6 blocks per endpoint: enough for intervals).
# 4. `bench serve` runs the captured workload (same seed) against each server, freshly
#    restarted, one after the other.
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
OUT=${1:?usage: LLAMA_BIN=... $0 OUT_DIR}
LLAMA_BIN=${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-server}
GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
mkdir -p "$OUT"
WORKLOAD=(--endpoint chat --dataset multi-turn --num-requests 64 --num-turns 4 --input-len 64
          --output-len 64 --request-rate 2 --no-progress)

wait_up() {
  for _ in $(seq 1 240); do
    curl -sf "$1/health" > /dev/null && return 0
    sleep 0.5
  done
  echo "server at $1 did not come up" >&2; return 1
}

# 1. the captured trace, by a Pagoda that then stops (the compared one starts with an empty
#    prefix cache)
$PAGODA serve --port 8002 --record-traffic "$OUT/trace.jsonl" > "$OUT/capture-serve.log" 2>&1 &
CAPTURE_PID=$!
wait_up http://127.0.0.1:8002
$PAGODA bench serve --base-url http://127.0.0.1:8002 "${WORKLOAD[@]}" --seed 1 \
  --output "$OUT/capture.json" > "$OUT/capture.txt"
kill $CAPTURE_PID; wait $CAPTURE_PID 2>/dev/null || true

# 2. the two servers
start_servers() {
  $PAGODA serve --port 8000 >> "$OUT/pagoda-serve.log" 2>&1 &
  PAGODA_PID=$!
  "$LLAMA_BIN/llama-server" -m "$GGUF" --host 127.0.0.1 --port 8081 --parallel 16 \
    --ctx-size 16384 --threads 2 --threads-batch 2 --no-webui >> "$OUT/llama-server.log" 2>&1 &
  LLAMA_PID=$!
  wait_up http://127.0.0.1:8000
  wait_up http://127.0.0.1:8081
}
stop_servers() {
  kill $PAGODA_PID $LLAMA_PID 2>/dev/null || true
  wait $PAGODA_PID $LLAMA_PID 2>/dev/null || true
}
trap stop_servers EXIT
start_servers

# 3. the A/B replay
$PAGODA bench ab --endpoint pagoda=http://127.0.0.1:8000 --endpoint llamacpp=http://127.0.0.1:8081 \
  --traffic "$OUT/trace.jsonl" --block-size 1000 --repeats 6 --slo ttft=1s,tpot=50ms \
  --label llamacpp="llama-server, 16 slots, 2 threads" --no-progress \
  --output "$OUT/ab.json" --html "$OUT/ab.html" > "$OUT/ab.txt"

# 4. separate runs of the very workload captured (same seed), on freshly started servers (no
#    prompt cache left by the replay)
stop_servers
start_servers
for side in pagoda:8000 llamacpp:8081; do
  $PAGODA bench serve --base-url "http://127.0.0.1:${side#*:}" "${WORKLOAD[@]}" --seed 1 \
    --output "$OUT/serve-${side%%:*}.json" > "$OUT/serve-${side%%:*}.txt"
done
$PAGODA bench compare "$OUT/serve-pagoda.json" "$OUT/serve-llamacpp.json" \
  --labels pagoda,llamacpp > "$OUT/compare-serve.md"
echo "wrote $OUT"
