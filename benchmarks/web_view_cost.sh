#!/usr/bin/env bash
# Issue 20's cost goal (BENCHMARKS.md section 16): the web page open on `pagoda serve` must
# cost the engine under 2% of its throughput. One server; `pagoda bench serve` (chat, random
# tokens, 32 requests of 128 in / 128 out, 8 at a time) runs without the page and with the
# page open in headless Chromium (its live view streaming /v1/engine/stream at 4 ticks a
# second, charts redrawn each tick), alternating none/page/none/page to average out drift.
# The browser runs on the same machine, so "page" also pays its rendering CPU: an upper
# bound on what the engine loses.
#
#   [VIEWER=stream] benchmarks/web_view_cost.sh OUT_DIR
#
# VIEWER=stream replaces the browser with curl reading the page's stream at the page's rate
# (4 ticks a second): what the server pays for an open page whose browser runs elsewhere,
# as it would in use (labels stream-1, stream-2).
#
# Needs chromium + chromium-driver (Debian) and selenium (pip install -e .[test]). Each run
# waits for the 1-minute load average to fall below 1.0 first (at most MAX_QUIET_WAIT_S).
set -euo pipefail
OUT=${1:?usage: web_view_cost.sh OUT_DIR}
mkdir -p "$OUT"
PY=.venv/bin/python
PAGODA=.venv/bin/pagoda
PORT=${PORT:-8772}
URL=http://127.0.0.1:$PORT
MAX_QUIET_WAIT_S=${MAX_QUIET_WAIT_S:-300}

source "$(dirname "$0")/lib.sh"  # quiet, start_server

open_page() {  # headless Chromium on the page until killed; prints the view's ticks at exit
  $PY - "$URL" <<'PY' &
import signal, sys, time
from selenium import webdriver
options = webdriver.ChromeOptions()
options.binary_location = "/usr/bin/chromium"
for argument in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"]:
    options.add_argument(argument)
driver = webdriver.Chrome(service=webdriver.ChromeService("/usr/bin/chromedriver"),
                          options=options)
driver.get(sys.argv[1] + "/")
def finish(*_):
    ticks = driver.find_element("id", "engine").get_attribute("data-ticks")
    print(f"page: {ticks} live-view ticks", flush=True)
    driver.quit()
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
while True:
    time.sleep(1)
PY
  PAGE=$!
  sleep 8  # the browser starts and the view connects
}

open_stream() {  # the live view's stream read at the page's rate, until killed
  ( while true; do curl -sN "$URL/v1/engine/stream?interval=0.25" > /dev/null; done ) &
  PAGE=$!
  sleep 1
}

VIEWER=${VIEWER:-page}
start_server web

round=0
for label in none-1 $VIEWER-1 none-2 $VIEWER-2; do
  round=$((round + 1))
  [ "${label%-*}" = page ] && open_page
  [ "${label%-*}" = stream ] && open_stream
  quiet
  $PAGODA bench serve --base-url "$URL" --endpoint chat --dataset random --num-requests 32 \
    --input-len 128 --output-len 128 --max-concurrency 8 --seed 1 --no-progress \
    --label "$label" --output "$OUT/$label.json" | tee "$OUT/$label.txt"
  if [ "${label%-*}" = page ]; then
    kill -TERM $PAGE; wait $PAGE | tee -a "$OUT/$label.txt" || true
  fi
  if [ "${label%-*}" = stream ]; then  # the loop, then its curl (else left orphaned)
    curls=$(pgrep -P $PAGE curl || true)
    kill $PAGE 2>/dev/null || true
    [ -z "$curls" ] || kill $curls 2>/dev/null || true
    wait $PAGE 2>/dev/null || true
  fi
done
kill -TERM $SERVER; wait $SERVER || true
$PAGODA bench compare "$OUT"/none-1.json "$OUT/$VIEWER-1.json" "$OUT"/none-2.json "$OUT/$VIEWER-2.json" \
  | tee "$OUT/compare.md"
