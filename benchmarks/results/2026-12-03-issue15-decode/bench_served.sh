#!/bin/bash
# Single-stream served decode, Q4_K_M, llama-server then pagoda serve, same client.
cd /work/main
B=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
M=/tmp/llamacpp/smollm2-q4_k_m.gguf
OUT=benchmarks/results/2026-12-03-issue15-decode
R=${1:-1}
cat /proc/loadavg
$B/llama-server -m $M --host 127.0.0.1 --port 8081 --parallel 1 --ctx-size 2048 --threads 2 --threads-batch 2 --no-webui > /tmp/llama-server.log 2>&1 &
LP=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:8081/health >/dev/null && break; sleep 1; done
.venv/bin/pagoda bench serve --base-url http://127.0.0.1:8081 --label llama.cpp --num-requests 8 --input-len 128 --output-len 128 --max-concurrency 1 --output $OUT/llamacpp-serve-$R.json > $OUT/llamacpp-serve-$R.txt 2>&1
kill $LP; wait $LP 2>/dev/null
.venv/bin/pagoda serve --model $M --port 8000 --no-access-log --max-model-len 2048 > /tmp/pagoda-serve.log 2>&1 &
PP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
.venv/bin/pagoda bench serve --base-url http://127.0.0.1:8000 --label pagoda --num-requests 8 --input-len 128 --output-len 128 --max-concurrency 1 --output $OUT/pagoda-serve-$R.json > $OUT/pagoda-serve-$R.txt 2>&1
kill $PP; wait $PP 2>/dev/null
.venv/bin/pagoda bench compare $OUT/llamacpp-serve-$R.json $OUT/pagoda-serve-$R.json
cat /proc/loadavg
