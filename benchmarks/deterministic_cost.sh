#!/usr/bin/env bash
# What --deterministic costs (BENCHMARKS.md section 20): the bundled model, the default mode
# and the batch-invariant one alternately in one run (the machine is shared and noisy):
# single-request latency (512-token prompt, 128 tokens out) and offline throughput
# (64 prompts, 128/128). Results: $OUT (default benchmarks/results/<date>-deterministic).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/$(date +%F)-deterministic}
mkdir -p "$OUT"
PAGODA=.venv/bin/pagoda
for round in 1 2; do
  for mode in default deterministic; do
    flag=$([ "$mode" = deterministic ] && echo --deterministic || echo --no-deterministic)
    $PAGODA bench latency $flag --input-len 512 --output-len 128 --num-iters 3 \
      --label "$mode" --output "$OUT/latency-$mode-$round.json" 2>/dev/null | tail -4
    $PAGODA bench throughput $flag --num-prompts 64 --input-len 128 --output-len 128 \
      --label "$mode" --output "$OUT/throughput-$mode-$round.json" 2>/dev/null | tail -3
  done
done
$PAGODA bench compare "$OUT"/latency-*.json > "$OUT/latency.md"
$PAGODA bench compare "$OUT"/throughput-*.json > "$OUT/throughput.md"
