# Shell helpers the benchmark scripts share; source it after setting OUT, PAGODA, PORT, URL.
#   quiet                  wait until the 1-minute load average is below 1.0 (the machine is
#                          shared), at most MAX_QUIET_WAIT_S (default 300); log it in OUT/load.txt
#   start_server LABEL ... `pagoda serve` on PORT with the given engine options, its log in
#                          OUT/server-LABEL.log; returns once /health answers, SERVER its pid

quiet() {
  local waited=0 limit=${MAX_QUIET_WAIT_S:-300}
  while awk '{exit !($1 >= 1.0)}' /proc/loadavg && [ $waited -lt "$limit" ]; do
    sleep 5; waited=$((waited + 5))
  done
  echo "load average before the run: $(cut -d' ' -f1-3 /proc/loadavg) (waited ${waited}s)" \
    | tee -a "$OUT/load.txt"
}

start_server() {
  local label=$1; shift
  $PAGODA serve --port "$PORT" --max-model-len 2048 --no-access-log "$@" \
    > "$OUT/server-$label.log" 2>&1 &
  SERVER=$!
  until curl -sf "$URL/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server-$label.log"; exit 1; }
    sleep 1
  done
}
