#!/bin/bash
# Issue 15 decode goal: rounds of llama-bench and pagoda bench latency back to back, both files.
cd /work/main
B=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
Q4KM=/tmp/llamacpp/smollm2-q4_k_m.gguf
Q41=$(.venv/bin/python -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
OUT=benchmarks/results/2026-12-03-issue15-decode
for round in 1 2 3 4 5; do
  cat /proc/loadavg
  $B/llama-bench -m $Q4KM -m $Q41 -t 2 -p 0 -n 128 -r 3 -o json > $OUT/llama-bench-$round.json 2>/dev/null
  for m in $Q4KM $Q41; do
    name=$(basename $m .gguf)
    .venv/bin/pagoda bench latency --model $m --input-len 128 --output-len 128 --num-iters 3 \
      --num-warmup-iters 1 --label pagoda-$name --output $OUT/pagoda-latency-$name-$round.json > $OUT/pagoda-latency-$name-$round.txt 2>&1
  done
done
cat /proc/loadavg
