#!/usr/bin/env bash
# Single-stream decode speed at a 16k-token depth: Pagoda against llama.cpp's llama-bench on
# the very same random-weight GGUF file (issue 37, part 3 "Long context").
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/long_context_decode.sh OUT_DIR [PAGODA_FLAGS...]
#
# Environment (defaults in brackets):
#   SHAPE     a benchmarks/synthetic_gguf.py shape [llama-3.2-1b]
#   OUTTYPE   the file's weight type, written by synthetic_gguf.py [q8_0]
#   DEPTH     tokens already in the context when decoding starts [16384]
#   GEN       decoded tokens measured [32]
#   REPS      measured repetitions of each engine [3]
#   THREADS   llama.cpp's threads (Pagoda picks its own: the machine's cores) [nproc]
#   WARMUP    Pagoda's untimed warm-up requests [1]
#   KV8=1     an 8-bit KV cache on both sides: Pagoda --kv-cache-dtype int8, llama.cpp
#             -ctk q8_0 -ctv q8_0 (with -fa 1, which its quantized V cache needs)
#   NO_LLAMA=1  Pagoda only, beside an llamacpp.json an earlier run left in OUT_DIR (another
#             Pagoda setting against the same llama-bench figures)
#   LABEL     the Pagoda run's name: OUT_DIR/LABEL.json, summary-LABEL.txt [pagoda]
#
# 1. synthetic_gguf.py writes SHAPE with a context of DEPTH + GEN + 64 tokens rounded up to a
#    power of two (no rope scaling: the file's own context covers the depth, so neither
#    engine refuses or extends it).
# 2. llama.cpp: `llama-bench -d DEPTH -n GEN -p 0`: the KV cache filled to DEPTH (untimed),
#    then GEN tokens decoded one at a time, REPS times; tg tok/s.
# 3. Pagoda: `pagoda bench latency --input-len DEPTH --output-len GEN+1`: a DEPTH-token
#    prompt prefilled (its time is TTFT, not counted), then GEN+1 tokens; decode tok/s is
#    GEN / (time from the first token to the last), i.e. the same GEN decode steps at depths
#    DEPTH .. DEPTH+GEN-1 as llama-bench's tg. One untimed warm-up request, then REPS.
# 4. summary-LABEL.txt: both figures side by side, and their ratio.
# Each engine runs alone (never both at once); each block waits for the 1-minute load
# average to fall below 1.0 first. Prefilling 16k tokens of a 1B model on a few CPU cores
# takes minutes per request: the whole script runs for tens of minutes.
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
OUT=${1:?usage: LLAMA_BIN=... $0 OUT_DIR [PAGODA_FLAGS...]}
shift
FLAGS=("$@")
[ -n "${NO_LLAMA:-}" ] || : "${LLAMA_BIN:?set LLAMA_BIN to the llama.cpp build/bin folder holding llama-bench}"
SHAPE=${SHAPE:-llama-3.2-1b}
OUTTYPE=${OUTTYPE:-q8_0}
DEPTH=${DEPTH:-16384}
GEN=${GEN:-32}
REPS=${REPS:-3}
THREADS=${THREADS:-$(nproc)}
WARMUP=${WARMUP:-1}
LABEL=${LABEL:-pagoda}
mkdir -p "$OUT"

CONTEXT=1
while [ "$CONTEXT" -lt $((DEPTH + GEN + 64)) ]; do CONTEXT=$((CONTEXT * 2)); done
GGUF="$OUT/$SHAPE-$OUTTYPE-ctx$CONTEXT.gguf"
quiet() { while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 5; done; }

# 1. the file
if [ ! -f "$GGUF" ]; then
  $PY benchmarks/synthetic_gguf.py "$SHAPE" "$GGUF" --outtype "$OUTTYPE" --context "$CONTEXT"
fi

LLAMA_KV=()
PAGODA_KV=()
if [ -n "${KV8:-}" ]; then
  LLAMA_KV=(-fa 1 -ctk q8_0 -ctv q8_0)
  PAGODA_KV=(--kv-cache-dtype int8)
fi

# 2. llama.cpp
if [ -z "${NO_LLAMA:-}" ]; then
  quiet
  "$LLAMA_BIN/llama-bench" -m "$GGUF" -d "$DEPTH" -n "$GEN" -p 0 -r "$REPS" -t "$THREADS" \
    "${LLAMA_KV[@]}" -o json > "$OUT/llamacpp.json" 2> "$OUT/llamacpp.log"
fi

# 3. Pagoda: the KV cache sized for one DEPTH + GEN + 1 token sequence (and some room)
quiet
$PAGODA bench latency --model "$GGUF" --input-len "$DEPTH" --output-len $((GEN + 1)) \
  --num-iters "$REPS" --num-warmup-iters "$WARMUP" --max-model-len $((DEPTH + GEN + 64)) \
  "${PAGODA_KV[@]}" "${FLAGS[@]}" --label "$LABEL" --output "$OUT/$LABEL.json" \
  > "$OUT/$LABEL.txt" 2> "$OUT/$LABEL.log"

# 4. side by side
$PY - "$OUT" "$DEPTH" "$GEN" "$LABEL" "${PAGODA_KV[*]} ${FLAGS[*]}" > "$OUT/summary-$LABEL.txt" <<'EOF'
import json
import sys

out, depth, gen, label, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
llama = [r for r in json.load(open(f"{out}/llamacpp.json")) if r.get("n_gen") == gen]
pagoda = json.load(open(f"{out}/{label}.json"))["summary"]["decode_tokens_per_s"]
print(f"single-stream decode of {gen} tokens at a depth of {depth} tokens")
for r in llama:
    print(f"  llama.cpp (llama-bench, {r['n_threads']} threads, type_k {r['type_k']}, "
          f"flash_attn {r.get('flash_attn')}): {r['avg_ts']:.2f} +- {r['stddev_ts']:.2f} tok/s")
print(f"  {label} (bench latency {flags.strip()}): median {pagoda['median']:.2f} tok/s, "
      f"mean {pagoda['mean']:.2f}")
for r in llama:
    print(f"  {label} / llama.cpp: {pagoda['median'] / r['avg_ts']:.2f}x (goal >= 1.0)")
EOF
cat "$OUT/summary-$LABEL.txt"
