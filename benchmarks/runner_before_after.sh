#!/usr/bin/env bash
# Issue 32: the same bench before (the worktree $BEFORE) and after (this tree), alternating,
# two rounds: single-request latency (128/128) and offline throughput (64 x 128/128).
# Run from the repository root: BEFORE=/tmp/before ./benchmarks/runner_before_after.sh
set -u
OUT=${OUT:-$(pwd)/benchmarks/results/$(date +%F)-runner-executor}
mkdir -p $OUT
PY=$(pwd)/.venv/bin/python
BEFORE=${BEFORE:?a worktree of the commit to compare with, e.g. git worktree add /tmp/before e156a72}
AFTER=$(pwd)
for round in 1 2; do
  for side in before after; do
    dir=$([ $side = before ] && echo "$BEFORE" || echo "$AFTER")
    (cd $dir && $PY -m pagoda bench latency --input-len 128 --output-len 128 --num-iters 5 \
       --label $side --output $OUT/latency-$side-$round.json > /dev/null 2>&1)
    (cd $dir && $PY -m pagoda bench throughput --num-prompts 64 --input-len 128 --output-len 128 \
       --label $side --output $OUT/throughput-$side-$round.json > /dev/null 2>&1)
  done
done
cd "$AFTER"
$PY -m pagoda bench compare $OUT/latency-*.json > $OUT/latency.md
$PY -m pagoda bench compare $OUT/throughput-*.json > $OUT/throughput.md
