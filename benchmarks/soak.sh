#!/usr/bin/env bash
# The long soak of issue 19 (BENCHMARKS.md section 14): `pagoda serve` on the bundled model
# with a KV cache too small for the load (preemptions happen), then `pagoda bench soak` for a
# fixed number of requests (4000 by default: about 30 minutes on 2 AVX2 cores).
#
#   benchmarks/soak.sh OUT_DIR [NUM_REQUESTS] [PAGODA_FLAGS...]
#
# OUT_DIR gets soak.json (the report: outcomes, errors by kind, greedy checks, preemptions,
# metrics after the drain, RSS samples), rss.png (the RSS curve), server.log and soak.txt.
# Exits 1 if a check failed (soak.txt says which).
set -euo pipefail
OUT=${1:?usage: soak.sh OUT_DIR [NUM_REQUESTS] [PAGODA_FLAGS...]}
NUM_REQUESTS=${2:-4000}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$OUT"
PORT=${PORT:-8765}
PAGODA=.venv/bin/pagoda
$PAGODA serve --port "$PORT" --dtype float32 --max-model-len 1024 \
  --kv-cache-memory 64000000 --no-access-log "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
set +e  # a failed check still stops the server and reports
$PAGODA bench soak --base-url "http://127.0.0.1:$PORT" --num-requests "$NUM_REQUESTS" \
  --max-concurrency 16 --sample-every 10 --output "$OUT/soak.json" --plot "$OUT/rss.png" \
  --no-progress 2>&1 | tee "$OUT/soak.txt"
status=${PIPESTATUS[0]}
set -e
kill -TERM $SERVER; wait $SERVER || true
grep -c Traceback "$OUT/server.log" | sed 's/^/tracebacks in the server log: /' | tee -a "$OUT/soak.txt"
exit "$status"
