#!/usr/bin/env bash
# Issue 6's four comparisons, back to back on one machine (see BENCHMARKS.md section 6).
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/perf_suite.sh OUT_DIR [PAGODA_FLAGS...]
#   LLAMA_BIN=... benchmarks/perf_suite.sh --model FILE.gguf OUT_DIR [PAGODA_FLAGS...]
#   SERVE_ONLY=1 LLAMA_BIN=... benchmarks/perf_suite.sh OUT_DIR [PAGODA_FLAGS...]   # blocks 2-4 only
#   NO_TRANSFORMERS=1 LLAMA_BIN=... benchmarks/perf_suite.sh OUT_DIR   # llama.cpp peers only
#
# --model: the GGUF file every engine runs (default: the bundled model); real-size files come
# from benchmarks/synthetic_gguf.py and llama-quantize (benchmarks/PEERS.md section 5).
# LLAMA_BIN holds llama-server and llama-batched-bench (built as in benchmarks/PEERS.md).
# PAGODA_FLAGS go to every Pagoda engine (e.g. --compile, --quantization int4). Each block waits for
# the 1-minute load average to fall below 1.0 first; results land in OUT_DIR as JSON/text.
set -euo pipefail
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
if [ "${1:-}" = --model ]; then
  GGUF=${2:?usage: perf_suite.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
  shift 2
fi
OUT=${1:?usage: perf_suite.sh [--model FILE.gguf] OUT_DIR [PAGODA_FLAGS...]}
shift
FLAGS=("$@")
: "${LLAMA_BIN:?set LLAMA_BIN to the llama.cpp build/bin folder}"
[ -f "$GGUF" ] || { echo "perf_suite.sh: no such model file: $GGUF" >&2; exit 2; }
mkdir -p "$OUT"
ENGINE=(--model "$GGUF" --max-model-len 2048 --kv-cache-memory 2147483648 "${FLAGS[@]}")

quiet() { while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 5; done; }
wait_up() { until curl -sf "$1/health" >/dev/null; do sleep 1; done; }

# 1. Offline throughput: transformers at batch 8, llama.cpp at 32 sequences, Pagoda on 256.
if [ -z "${SERVE_ONLY:-}" ]; then
if [ -z "${NO_TRANSFORMERS:-}" ]; then
quiet; $PY benchmarks/transformers_baseline.py --model "$GGUF" --num-prompts 32 --input-len 128 \
  --output-len 128 --batch-size 8 --output "$OUT/transformers-b8.json"
fi
quiet; "$LLAMA_BIN/llama-batched-bench" -m "$GGUF" -c 8192 -b 2048 -ub 512 -t 2 \
  -npp 128 -ntg 128 -npl 1,32 2>/dev/null | grep '^|' > "$OUT/llamacpp-batched.txt"
quiet; $PAGODA bench throughput --num-prompts 256 --input-len 128 --output-len 128 \
  --max-num-seqs 256 "${ENGINE[@]}" --label pagoda --output "$OUT/pagoda-throughput.json"
fi

# 2-4. Serving at 16 streams, a 512-token prompt on an idle server, one stream.
# SERVE_ONLY=1 skips the offline block (1) above.
serve_runs() {  # $1 base url, $2 label; a seed per run: no run reuses another's prompts
  # (with the same seed, random prompts of equal length repeat, and a prefix cache would hit)
  $PAGODA bench serve --base-url "$1" --label "$2" --num-requests 32 --input-len 128 \
    --output-len 128 --max-concurrency 16 --seed 1 --output "$OUT/$2-serve16.json" --no-progress
  $PAGODA bench serve --base-url "$1" --label "$2" --num-requests 5 --input-len 512 \
    --output-len 1 --max-concurrency 1 --seed 2 --output "$OUT/$2-ttft512.json" --no-progress
  $PAGODA bench serve --base-url "$1" --label "$2" --num-requests 3 --input-len 128 \
    --output-len 128 --max-concurrency 1 --seed 3 --output "$OUT/$2-single.json" --no-progress
}
quiet
"$LLAMA_BIN/llama-server" -m "$GGUF" --host 127.0.0.1 --port 8081 --parallel 16 \
  --ctx-size 16384 --threads 2 --threads-batch 2 --no-webui > "$OUT/llama-server.log" 2>&1 &
LLAMA_PID=$!
wait_up http://127.0.0.1:8081
serve_runs http://127.0.0.1:8081 llamacpp
kill $LLAMA_PID; wait $LLAMA_PID 2>/dev/null || true

quiet
$PAGODA serve --port 8000 --no-access-log "${ENGINE[@]}" > "$OUT/pagoda-server.log" 2>&1 &
PAGODA_PID=$!
wait_up http://127.0.0.1:8000
serve_runs http://127.0.0.1:8000 pagoda
kill $PAGODA_PID; wait $PAGODA_PID 2>/dev/null || true

for run in serve16 ttft512 single; do
  $PAGODA bench compare "$OUT/llamacpp-$run.json" "$OUT/pagoda-$run.json" > "$OUT/compare-$run.md"
done
if [ -z "${SERVE_ONLY:-}" ] && [ -z "${NO_TRANSFORMERS:-}" ]; then
  $PAGODA bench compare "$OUT/transformers-b8.json" "$OUT/pagoda-throughput.json" \
    > "$OUT/compare-throughput.md"
fi
if [ -z "${SERVE_ONLY:-}" ]; then
  cat "$OUT/llamacpp-batched.txt"
fi
cat "$OUT"/compare-*.md
