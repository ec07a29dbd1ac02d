#!/usr/bin/env bash
# Issue 18's throughput goal (BENCHMARKS.md): data parallelism with one thread per replica,
# DP=2, must give >= 0.9x the output tokens/s of one engine with two threads, at 16
# concurrent streams, on this 2-core machine: the router and the replica processes cost
# little. `pagoda bench serve` (completions, random tokens, 64 requests of 128 in / 128 out,
# 16 at a time; and a shared-prefix run, where cache-aware routing matters) runs against
# each server in turn, alternating single/dp/single/dp to average out the machine's drift.
#
#   benchmarks/data_parallel.sh OUT_DIR
#
# Each run waits for the 1-minute load average to fall below 1.0 first (at most
# MAX_QUIET_WAIT_S).
set -euo pipefail
OUT=${1:?usage: data_parallel.sh OUT_DIR}
mkdir -p "$OUT"
PAGODA=.venv/bin/pagoda
PORT=${PORT:-8773}
URL=http://127.0.0.1:$PORT
MAX_QUIET_WAIT_S=${MAX_QUIET_WAIT_S:-300}
DATASETS=${DATASETS:-random shared-prefix}

source "$(dirname "$0")/lib.sh"  # quiet, start_server

for round in 1 2; do
  for label in single dp; do
    if [ $label = single ]; then
      start_server single --data-parallel-size 1       # one engine, two threads
    else
      start_server dp --data-parallel-size 2           # two replicas, one thread each
    fi
    for dataset in $DATASETS; do
      quiet
      $PAGODA bench serve --base-url "$URL" --dataset "$dataset" --num-requests 64 \
        --input-len 128 --output-len 128 --max-concurrency 16 --seed 1 --num-warmups 2 \
        --no-progress --label "$label-$dataset-$round" \
        --output "$OUT/$label-$dataset-$round.json" | tee "$OUT/$label-$dataset-$round.txt"
    done
    kill -TERM $SERVER; wait $SERVER || true
  done
done
for dataset in $DATASETS; do
  $PAGODA bench compare "$OUT"/single-$dataset-1.json "$OUT"/dp-$dataset-1.json \
    "$OUT"/single-$dataset-2.json "$OUT"/dp-$dataset-2.json | tee "$OUT/compare-$dataset.md"
done
