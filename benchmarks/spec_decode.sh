#!/usr/bin/env bash
# Issue 17's speed goals (BENCHMARKS.md section 15): `pagoda serve` without and with n-gram
# speculation, each driven by `pagoda bench serve` on the input-grounded workload (1 and 4
# streams, greedy; 1 stream at temperature 0.7) and on random tokens (1 stream); then, where LLAMA_BIN is set, llama.cpp's
# llama-cli against its llama-lookup (prompt-lookup speculation) on the same prompts.
#
#   [LLAMA_BIN=/path/to/llama.cpp/build/bin] benchmarks/spec_decode.sh OUT_DIR [SPEC_JSON]
#
# Every figure lands in OUT_DIR (one JSON per bench run, llama.cpp's timing lines in
# llamacpp.txt). Runs wait for the 1-minute load average to fall below 1.0 first.
set -euo pipefail
OUT=${1:?usage: spec_decode.sh OUT_DIR [SPEC_JSON]}
SPEC=${2:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
mkdir -p "$OUT"
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
PORT=${PORT:-8771}
URL=http://127.0.0.1:$PORT

source "$(dirname "$0")/lib.sh"  # quiet, start_server

bench() {  # $1 label; the rest go to pagoda bench serve
  local label=$1; shift
  quiet
  $PAGODA bench serve --base-url "$URL" --endpoint chat --temperature 0 --no-progress \
    --label "$label" --output "$OUT/$label.json" "$@" | tee "$OUT/$label.txt"
}

for mode in off ngram; do
  flags=()
  [ "$mode" = ngram ] && flags=(--speculative-config "$SPEC")
  start_server "$mode" "${flags[@]}"
  bench "$mode-grounded-c1" --dataset grounded --num-requests 8 --output-len 128 --max-concurrency 1
  bench "$mode-grounded-c4" --dataset grounded --num-requests 16 --output-len 128 --max-concurrency 4 --seed 1
  bench "$mode-grounded-c1-t07" --dataset grounded --num-requests 8 --output-len 128 --max-concurrency 1 --temperature 0.7 --seed 3
  bench "$mode-random-c1" --dataset random --num-requests 8 --input-len 128 --output-len 128 --max-concurrency 1 --seed 2
  kill -TERM $SERVER; wait $SERVER || true
done
$PAGODA bench compare "$OUT"/off-*.json "$OUT"/ngram-*.json | tee "$OUT/compare.md"

if [ -n "${LLAMA_BIN:-}" ]; then
  GGUF=$($PY -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
  $PY benchmarks/grounded_prompts.py "$OUT/prompts" 4
  : > "$OUT/llamacpp.txt"
  for prompt in "$OUT"/prompts/grounded_*.txt; do
    quiet
    echo "== $prompt: llama-cli" >> "$OUT/llamacpp.txt"
    "$LLAMA_BIN/llama-cli" -m "$GGUF" -f "$prompt" -n 128 --temp 0 -t 2 -c 2048 --ignore-eos \
      -no-cnv < /dev/null 2>&1 | grep -E "^llama_perf_context_print: +eval time" >> "$OUT/llamacpp.txt"
    echo "== $prompt: llama-lookup --draft 3" >> "$OUT/llamacpp.txt"
    "$LLAMA_BIN/llama-lookup" -m "$GGUF" -f "$prompt" -n 128 --draft 3 --temp 0 -t 2 -c 2048 \
      --ignore-eos 2>&1 | grep -E "^decoded|^n_drafted|^n_accept" >> "$OUT/llamacpp.txt"
  done
  cat "$OUT/llamacpp.txt"
fi
