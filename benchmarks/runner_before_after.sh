#!/usr/bin/env bash
# Issue 32: the same bench before (the worktree $BEFORE) and after (this tree), alternating,
# two rounds: single-request latency (128/128), offline throughput (64 x 128/128) and a served
# run at 16 streams (32 requests of 128/128 through `pagoda serve` on port 8010).
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
    (cd $dir && exec $PY -m pagoda serve --port 8010 --no-access-log > $OUT/serve-$side-$round.log 2>&1) &
    until curl -sf http://127.0.0.1:8010/health > /dev/null; do sleep 1; done
    $PY -m pagoda bench serve --base-url http://127.0.0.1:8010 --num-requests 32 --input-len 128 \
      --output-len 128 --max-concurrency 16 --seed $round --label $side --no-progress \
      --output $OUT/serve16-$side-$round.json > /dev/null 2>&1
    pkill -f "pagoda serve --port 8010"; wait
  done
done
cd "$AFTER"
$PY -m pagoda bench compare $OUT/latency-*.json > $OUT/latency.md
$PY -m pagoda bench compare $OUT/throughput-*.json > $OUT/throughput.md
$PY -m pagoda bench compare $OUT/serve16-*.json > $OUT/serve16.md
