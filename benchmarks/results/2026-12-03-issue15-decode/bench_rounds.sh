#!/bin/bash
# Issue 15 decode goal, matched contexts: llama-bench tg128 from an empty context (-d 0) and
# after 128 tokens (-d 128), Pagoda's bench latency after a 1- and a 128-token prompt; both
# files; rounds back to back.
cd /work/main
B=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
Q4KM=/tmp/llamacpp/smollm2-q4_k_m.gguf
Q41=$(.venv/bin/python -c "from pagoda.executor.loader.model_files import bundled_model_path as p; print(p())")
OUT=benchmarks/results/2026-12-03-issue15-decode
for round in a b c; do
  cat /proc/loadavg
  $B/llama-bench -m $Q4KM -m $Q41 -t 2 -p 0 -n 128 -d 0,128 -r 3 -o json > $OUT/llama-bench-depth-$round.json 2>/dev/null
  for m in $Q4KM $Q41; do
    name=$(basename $m .gguf)
    for input in 1 128; do
      .venv/bin/pagoda bench latency --model $m --input-len $input --output-len 128 --num-iters 3 \
        --num-warmup-iters 1 --output $OUT/pagoda-latency-$name-in$input-$round.json > /dev/null 2>&1
    done
  done
done
cat /proc/loadavg
