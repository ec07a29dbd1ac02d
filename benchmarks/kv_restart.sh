#!/usr/bin/env bash
# Issue 37's restart goal: a returning 4,000-token conversation after a server restart, served
# from the disk tier, against its cold prefill: restarted TTFT / cold TTFT (goal <= 0.2).
#
#   benchmarks/kv_restart.sh OUT_DIR [PAGODA_FLAGS...]
#   benchmarks/kv_restart.sh --model FILE.gguf OUT_DIR [PAGODA_FLAGS...]
#
# 1. A Pagoda with the tiers (--kv-offload-memory, --kv-offload-dir on an empty folder) gets
#    CONVERSATIONS (default 3) prompts of PROMPT_LEN (default 4000) tokens, one at a time:
#    each TTFT is a cold prefill.
# 2. It stops (SIGTERM: a clean shutdown writes the pool's cached blocks to the disk tier) and a
#    fresh one starts on the same --kv-offload-dir.
# 3. The same prompts (same seed) again, one at a time: each TTFT now reads its blocks back.
# The ratio is of the medians; the restarted server's kv_offload counters (disk hits, bytes
# read) land in OUT_DIR/metrics-restarted.txt as the proof that the disk tier served them.
# Env: PROMPT_LEN, OUTPUT_LEN (16), CONVERSATIONS, DTYPE (auto). Every run waits for the
# 1-minute load average to fall below 1.0 first (lib.sh's quiet).
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
if [ "${1:-}" = --model ]; then
  GGUF=${2:?usage: kv_restart.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
  shift 2
fi
OUT=${1:?usage: kv_restart.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
shift
FLAGS=("$@")
[ -f "$GGUF" ] || { echo "kv_restart.sh: no such model file: $GGUF" >&2; exit 2; }
$PAGODA serve --help | grep -q -- --kv-offload-dir \
  || { echo "kv_restart.sh: this Pagoda has no --kv-offload-dir (issue 37's tiers)" >&2; exit 2; }
mkdir -p "$OUT"
PORT=${PORT:-8775}
URL=http://127.0.0.1:$PORT
PROMPT_LEN=${PROMPT_LEN:-4000} OUTPUT_LEN=${OUTPUT_LEN:-16} CONVERSATIONS=${CONVERSATIONS:-3}
DTYPE=${DTYPE:-auto}

source "$(dirname "$0")/lib.sh"  # quiet, start_server
SERVER=
trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null || true' EXIT

# Sizes: the pool holds every conversation (so that the shutdown flush has them all), the host
# tier and the disk quota twice that.
read -r BYTES_PER_TOKEN CONTEXT < <($PY "$(dirname "$0")/kv_bytes_per_token.py" "$GGUF" "$DTYPE")
MAX_MODEL_LEN=$(( (PROMPT_LEN + OUTPUT_LEN + 64 + 255) / 256 * 256 ))
[ "$MAX_MODEL_LEN" -le "$CONTEXT" ] \
  || { echo "kv_restart.sh: $PROMPT_LEN tokens exceed the model's context ($CONTEXT)" >&2; exit 2; }
KV_CACHE_BYTES=$((CONVERSATIONS * MAX_MODEL_LEN * BYTES_PER_TOKEN))
TIER_BYTES=$((2 * KV_CACHE_BYTES))
tee "$OUT/arithmetic.txt" <<EOF
model: $GGUF (context $CONTEXT), Pagoda dtype $DTYPE: $BYTES_PER_TOKEN KV bytes per token
$CONVERSATIONS conversations of $PROMPT_LEN tokens in, $OUTPUT_LEN out -> --max-model-len $MAX_MODEL_LEN
KV pool: $CONVERSATIONS x $MAX_MODEL_LEN x $BYTES_PER_TOKEN = $KV_CACHE_BYTES B; host tier and disk quota: $TIER_BYTES B each
EOF

ENGINE=(--model "$GGUF" --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN"
        --kv-cache-memory "$KV_CACHE_BYTES" --kv-offload-memory "$TIER_BYTES"
        --kv-offload-dir "$OUT/kv-disk" --kv-offload-disk-bytes "$TIER_BYTES" "${FLAGS[@]}")
WORKLOAD=(--endpoint completions --dataset random --num-requests "$CONVERSATIONS"
          --input-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --max-concurrency 1
          --tokenizer "$GGUF" --seed 11 --no-progress)

bench() {  # $1 label
  quiet
  $PAGODA bench serve --base-url "$URL" "${WORKLOAD[@]}" --label "$1" \
    --output "$OUT/$1.json" | tee "$OUT/$1.txt"
}

# 1. cold: an empty disk tier, a fresh server
rm -rf "$OUT/kv-disk"; mkdir -p "$OUT/kv-disk"
start_server cold "${ENGINE[@]}"
bench cold
kill -TERM $SERVER; wait $SERVER || true; SERVER=
echo "disk tier after the shutdown: $(du -sb "$OUT/kv-disk" | cut -f1) bytes in" \
  "$(find "$OUT/kv-disk" -type f | wc -l) files" | tee -a "$OUT/arithmetic.txt"

# 2. restarted on the same folder, the same prompts
start_server restarted "${ENGINE[@]}"
bench restarted
curl -sf "$URL/metrics" | grep -E 'kv_offload|prefix_cache' > "$OUT/metrics-restarted.txt" || true
kill -TERM $SERVER; wait $SERVER || true; SERVER=

$PAGODA bench compare "$OUT/cold.json" "$OUT/restarted.json" > "$OUT/compare.md"
$PY - "$OUT/cold.json" "$OUT/restarted.json" <<'EOF' | tee "$OUT/summary.txt"
import json
import sys

runs = [json.load(open(path))["runs"][0] for path in sys.argv[1:]]
for name, run in zip(("cold", "restarted"), runs):
    ttfts = [r["ttft"] for r in run["requests"]]
    assert all(r["success"] for r in run["requests"]), f"{name}: a request failed"
    print(f"{name:<10} TTFT per conversation (ms): "
          + ", ".join(f"{t * 1000:.1f}" for t in ttfts)
          + f"; median {run['summary']['ttft_s']['median'] * 1000:.1f}")
cold, restarted = (run["summary"]["ttft_s"]["median"] for run in runs)
print(f"restarted / cold TTFT: {restarted / cold:.3f} (goal <= 0.2)")
EOF
echo "wrote $OUT"
