#!/usr/bin/env bash
# Issue 37's multi-turn goal: 32 users x 8 turns behind a shared 1,000-token system prompt,
# every turn re-sending the whole history (the server's own replies included), on a KV pool a
# quarter the size of the histories: P95 TTFT of the turns from the second on, for
#   1. Pagoda without tiers (an evicted history is prefilled again),
#   2. Pagoda with the host-memory tier (--kv-offload-memory) and a disk tier (--kv-offload-dir),
#   3. llama-server with its prompt cache (--cache-reuse 256, --slot-save-path, and --cache-ram
#      where this llama.cpp has it), one slot per request in flight,
# then the ratios (goal: no tiers / tiers >= 3, llama-server / tiers > 1).
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/multi_turn_tiers.sh OUT_DIR [PAGODA_FLAGS...]
#   LLAMA_BIN=... benchmarks/multi_turn_tiers.sh --model FILE.gguf OUT_DIR [PAGODA_FLAGS...]
#   NO_LLAMA=1 benchmarks/multi_turn_tiers.sh OUT_DIR        # the two Pagoda runs only
#
# --model: the GGUF every server runs (default: the bundled model); a real-size file comes from
# benchmarks/synthetic_gguf.py (e.g. llama-3.2-1b; its tokenizer is the bundled one). Sizes
# (env): USERS=32 TURNS=8 SYSTEM_LEN=1000 INPUT_LEN=64 OUTPUT_LEN=64, DTYPE=auto (Pagoda's run
# dtype, which sets the KV bytes per token), MAX_CONCURRENCY (default: the sequences at full
# length that fit the pool). PAGODA_FLAGS go to both Pagoda servers. llama-server is built as
# in benchmarks/PEERS.md. Every run waits for the 1-minute load average to fall below 1.0
# first (lib.sh's quiet); results land in OUT_DIR (one JSON and text per run, compare.md,
# arithmetic.txt, summary.txt).
#
# The prompts go to /v1/completions (the history concatenated, no chat template), so the token
# arithmetic below is the prompts' own. llama-server's --slot-save-path enables its
# /slots?action=save|restore API; `pagoda bench serve` never calls it (an OpenAI client does
# not), so slot save/restore is on but unused unless llama-server saves on its own; --cache-ram
# (newer llama.cpp) is its automatic host-memory prompt cache, given the same bytes as
# Pagoda's host tier.
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
if [ "${1:-}" = --model ]; then
  GGUF=${2:?usage: multi_turn_tiers.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
  shift 2
fi
OUT=${1:?usage: multi_turn_tiers.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
shift
FLAGS=("$@")
[ -f "$GGUF" ] || { echo "multi_turn_tiers.sh: no such model file: $GGUF" >&2; exit 2; }
[ -n "${NO_LLAMA:-}" ] || : "${LLAMA_BIN:?set LLAMA_BIN to the llama.cpp build/bin folder (or NO_LLAMA=1)}"
$PAGODA serve --help | grep -q -- --kv-offload-memory \
  || { echo "multi_turn_tiers.sh: this Pagoda has no --kv-offload-memory (issue 37's tiers)" >&2; exit 2; }
mkdir -p "$OUT"
PORT=${PORT:-8773}
URL=http://127.0.0.1:$PORT
LLAMA_PORT=${LLAMA_PORT:-8774}
USERS=${USERS:-32} TURNS=${TURNS:-8} SYSTEM_LEN=${SYSTEM_LEN:-1000}
INPUT_LEN=${INPUT_LEN:-64} OUTPUT_LEN=${OUTPUT_LEN:-64} DTYPE=${DTYPE:-auto}
BLOCK=16  # Pagoda's default --block-size

source "$(dirname "$0")/lib.sh"  # quiet, start_server
SERVER=
trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null || true' EXIT

# ---- the arithmetic: KV bytes per token, the histories' tokens, the pool a quarter of them ----
read -r BYTES_PER_TOKEN CONTEXT < <($PY "$(dirname "$0")/kv_bytes_per_token.py" "$GGUF" "$DTYPE")
TURN_TOKENS=$((INPUT_LEN + OUTPUT_LEN))
# the longest request: the system prompt, every turn with its reply (the last reply generated),
# and a little room for a BOS and the re-tokenized replies
MAX_SEQ=$((SYSTEM_LEN + TURNS * TURN_TOKENS + 32))
MAX_MODEL_LEN=$(( (MAX_SEQ + 255) / 256 * 256 ))
# what the whole run leaves behind: the shared system prompt once, every user's turns and replies
HISTORY_TOKENS=$((SYSTEM_LEN + USERS * TURNS * TURN_TOKENS))
POOL_TOKENS=$((HISTORY_TOKENS / 4 / BLOCK * BLOCK))
KV_CACHE_BYTES=$((POOL_TOKENS * BYTES_PER_TOKEN))
HOST_TIER_BYTES=$((HISTORY_TOKENS * BYTES_PER_TOKEN * 5 / 4))  # all the histories, and a margin
DISK_TIER_BYTES=$((HISTORY_TOKENS * BYTES_PER_TOKEN * 2))
CONCURRENCY=${MAX_CONCURRENCY:-$(( POOL_TOKENS / MAX_SEQ > 0 ? POOL_TOKENS / MAX_SEQ : 1 ))}
[ "$MAX_MODEL_LEN" -le "$CONTEXT" ] \
  || { echo "multi_turn_tiers.sh: a full conversation ($MAX_SEQ tokens) exceeds the model's context ($CONTEXT)" >&2; exit 2; }
[ "$POOL_TOKENS" -ge "$MAX_MODEL_LEN" ] \
  || { echo "multi_turn_tiers.sh: the pool ($POOL_TOKENS tokens) cannot hold one conversation ($MAX_MODEL_LEN)" >&2; exit 2; }
tee "$OUT/arithmetic.txt" <<EOF
model: $GGUF (context $CONTEXT), Pagoda dtype $DTYPE: $BYTES_PER_TOKEN KV bytes per token
workload: $USERS users x $TURNS turns, system prompt $SYSTEM_LEN tokens, turns of $INPUT_LEN tokens in, $OUTPUT_LEN out
longest request: $SYSTEM_LEN + $TURNS x $TURN_TOKENS + 32 (BOS, re-tokenized replies) = $MAX_SEQ tokens -> --max-model-len $MAX_MODEL_LEN
histories: $SYSTEM_LEN (shared once) + $USERS x $TURNS x $TURN_TOKENS = $HISTORY_TOKENS tokens
KV pool: $HISTORY_TOKENS / 4 = $POOL_TOKENS tokens (whole blocks of $BLOCK) x $BYTES_PER_TOKEN B = $KV_CACHE_BYTES B -> --kv-cache-memory $KV_CACHE_BYTES
  (histories / pool = $(awk -v h="$HISTORY_TOKENS" -v p="$POOL_TOKENS" 'BEGIN {printf "%.2f", h / p}')x)
host tier: $HISTORY_TOKENS x $BYTES_PER_TOKEN x 1.25 = $HOST_TIER_BYTES B; disk tier quota: 2x the histories = $DISK_TIER_BYTES B
requests in flight: $CONCURRENCY (the pool holds $POOL_TOKENS / $MAX_SEQ full-length sequences; MAX_CONCURRENCY overrides)
llama-server: $CONCURRENCY slots x $MAX_MODEL_LEN tokens = --ctx-size $((CONCURRENCY * MAX_MODEL_LEN))
EOF

WORKLOAD=(--endpoint completions --dataset multi-turn --num-users "$USERS" --num-turns "$TURNS"
          --system-prompt-len "$SYSTEM_LEN" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
          --max-concurrency "$CONCURRENCY" --tokenizer "$GGUF" --seed 1 --no-progress)
ENGINE=(--model "$GGUF" --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN"
        --kv-cache-memory "$KV_CACHE_BYTES" "${FLAGS[@]}")

bench() {  # $1 label, $2 base URL
  quiet
  $PAGODA bench serve --base-url "$2" "${WORKLOAD[@]}" --label "$1" --output "$OUT/$1.json" \
    | tee "$OUT/$1.txt"
}

# 1. Pagoda without tiers
start_server notiers "${ENGINE[@]}"
bench pagoda-notiers "$URL"
curl -sf "$URL/metrics" | grep -E 'prefix_cache|prompt_tokens' > "$OUT/metrics-notiers.txt" || true
kill -TERM $SERVER; wait $SERVER || true; SERVER=

# 2. Pagoda with the host tier and a disk tier (an empty folder: no entries from earlier runs)
rm -rf "$OUT/kv-disk"; mkdir -p "$OUT/kv-disk"
start_server tiers "${ENGINE[@]}" --kv-offload-memory "$HOST_TIER_BYTES" \
  --kv-offload-dir "$OUT/kv-disk" --kv-offload-disk-bytes "$DISK_TIER_BYTES"
bench pagoda-tiers "$URL"
curl -sf "$URL/metrics" | grep -E 'kv_offload|prefix_cache' > "$OUT/metrics-tiers.txt" || true
kill -TERM $SERVER; wait $SERVER || true; SERVER=

# 3. llama-server with its prompt cache
RESULTS=("$OUT/pagoda-notiers.json" "$OUT/pagoda-tiers.json")
if [ -z "${NO_LLAMA:-}" ]; then
  LLAMA_FLAGS=(--cache-reuse 256 --slot-save-path "$OUT/llama-slots")
  if "$LLAMA_BIN/llama-server" --help 2>&1 | grep -q -- --cache-ram; then
    LLAMA_FLAGS+=(--cache-ram $((HOST_TIER_BYTES >> 20)))  # MiB
  else
    echo "this llama-server has no --cache-ram: its prompt cache is the slots' own KV" \
      | tee -a "$OUT/arithmetic.txt"
  fi
  rm -rf "$OUT/llama-slots"; mkdir -p "$OUT/llama-slots"
  "$LLAMA_BIN/llama-server" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" \
    --parallel "$CONCURRENCY" --ctx-size $((CONCURRENCY * MAX_MODEL_LEN)) --threads 2 \
    --threads-batch 2 --no-webui "${LLAMA_FLAGS[@]}" > "$OUT/llama-server.log" 2>&1 &
  SERVER=$!
  until curl -sf "http://127.0.0.1:$LLAMA_PORT/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/llama-server.log"; exit 1; }
    sleep 1
  done
  bench llamacpp "http://127.0.0.1:$LLAMA_PORT"
  kill -TERM $SERVER; wait $SERVER || true; SERVER=
  RESULTS+=("$OUT/llamacpp.json")
fi

$PAGODA bench compare "${RESULTS[@]}" > "$OUT/compare.md"
$PY - "${RESULTS[@]}" <<'EOF' | tee "$OUT/summary.txt"
import json
import sys

p95 = {}
for path in sys.argv[1:]:
    result = json.load(open(path))
    summary = result["runs"][0]["summary"]
    later = summary["ttft_later_turns_s"]
    p95[result["label"]] = later["p95"]
    print(f"{result['label']:<16} P95 TTFT of turns >= 2: {later['p95'] * 1000:9.1f} ms "
          f"(median {later['median'] * 1000:.1f} ms; {summary['completed']}/"
          f"{summary['num_requests']} requests ok)")
tiers = p95["pagoda-tiers"]
print(f"no tiers / tiers:     {p95['pagoda-notiers'] / tiers:.2f}x (goal >= 3)")
if "llamacpp" in p95:
    print(f"llama-server / tiers: {p95['llamacpp'] / tiers:.2f}x (goal > 1)")
EOF
echo "wrote $OUT"
