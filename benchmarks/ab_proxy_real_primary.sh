#!/usr/bin/env bash
# What `pagoda ab-proxy` costs in front of a real Pagoda primary (the bundled model) at 16
# streams, mirroring and splitting to a fake candidate (no model: the shadows' compute must not
# land on a small machine's primary). Results in OUT_DIR (mirror.* and split.*).
#
#   benchmarks/ab_proxy_real_primary.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p $OUT
.venv/bin/pagoda serve --port 8000 > $OUT/pagoda-serve.log 2>&1 &
P=$!
.venv/bin/python -c "import uvicorn; from tests.helpers.fake_server import build_app; uvicorn.run(build_app(0.005), host='127.0.0.1', port=8003, log_level='critical')" &
F=$!
trap 'kill $P $F 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 0.5; done
sleep 2
.venv/bin/python benchmarks/ab_proxy_overhead.py --primary http://127.0.0.1:8000 --candidate http://127.0.0.1:8003 \
  --model SmolLM2-135M-Instruct.Q4_1.gguf --blocks 3 --output $OUT/mirror.json > $OUT/mirror.txt 2>&1
.venv/bin/python benchmarks/ab_proxy_overhead.py --primary http://127.0.0.1:8000 --candidate http://127.0.0.1:8003 \
  --model SmolLM2-135M-Instruct.Q4_1.gguf --blocks 3 --split 0.1 --output $OUT/split.json > $OUT/split.txt 2>&1
echo done
