#!/usr/bin/env bash
# Issue 35's speed goals (BENCHMARKS.md, "Issue 35: LoRA adapters"): the bundled model served
# without adapters, then with four rank-16 adapters on every linear (benchmarks/lora_adapters.py),
# each driven by `pagoda bench serve` on the same random workload:
#   - 16 concurrent streams: base alone, then spread over the 4 adapters (--lora-names);
#   - 1 stream: base alone, then every request through one adapter;
# and the resident memory each server holds after loading its adapters.
#
#   [ADAPTER_DTYPE=bfloat16|float32] benchmarks/lora_serving.sh OUT_DIR
#
# (adapters saved in ADAPTER_DTYPE, default bfloat16 as adapters trained in bf16 are saved;
# `--lora-dtype auto` serves each in its file's dtype)
# Every figure lands in OUT_DIR (one JSON per bench run; rss.txt). Runs wait for the 1-minute
# load average to fall below 1.0 first.
set -euo pipefail
OUT=${1:?usage: lora_serving.sh OUT_DIR}
mkdir -p "$OUT"
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
PORT=${PORT:-8772}
URL=http://127.0.0.1:$PORT

source "$(dirname "$0")/lib.sh"  # quiet, start_server

[ -d "$OUT/adapters/adapter-3" ] || $PY benchmarks/lora_adapters.py "$OUT/adapters" --count 4 --rank 16 \
  --dtype "${ADAPTER_DTYPE:-bfloat16}"
MODULES=()
for i in 0 1 2 3; do MODULES+=("a$i=$OUT/adapters/adapter-$i"); done

bench() {  # $1 label; the rest go to pagoda bench serve
  local label=$1; shift
  quiet
  $PAGODA bench serve --base-url "$URL" --no-progress --dataset random --input-len 128 \
    --output-len 128 --label "$label" --output "$OUT/$label.json" "$@" | tee "$OUT/$label.txt"
}

rss() {  # $1 label: the server's resident memory once loaded (and after its runs)
  echo "$1: $(awk '/VmRSS/ {print $2, $3}' /proc/$SERVER/status)" | tee -a "$OUT/rss.txt"
}

: > "$OUT/rss.txt"
for mode in base lora; do
  flags=()
  [ "$mode" = lora ] && flags=(--enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules "${MODULES[@]}")
  start_server "$mode" "${flags[@]}"
  rss "$mode-loaded"
  names=()
  [ "$mode" = lora ] && names=(--lora-names a0,a1,a2,a3)
  bench "$mode-c16" --num-requests 64 --max-concurrency 16 --seed 1 "${names[@]}"
  [ "$mode" = lora ] && names=(--lora-names a0)
  bench "$mode-c1" --num-requests 8 --max-concurrency 1 --seed 2 "${names[@]}"
  rss "$mode-after-runs"
  kill -TERM $SERVER; wait $SERVER || true
done
$PAGODA bench compare "$OUT"/base-*.json "$OUT"/lora-*.json | tee "$OUT/compare.md"
du -sb "$OUT"/adapters/adapter-* | tee -a "$OUT/rss.txt"
