#!/usr/bin/env bash
# Runs tests N times and lists every test that failed even once, with its count: a test that
# fails one run in five lands a submission by luck on some CPU. By default the tests marked
# slow (the end-to-end runs: servers, real models); any pytest arguments narrow or widen it.
#
#   benchmarks/flake_check.sh 5 tests/ab/test_real_servers.py       # one file, 5 runs
#   benchmarks/flake_check.sh 20 tests/ab/test_real_servers.py -k identical
#   benchmarks/flake_check.sh 3                                   # every slow test, 3 runs
#
# KEEP=DIR keeps each run's pytest temporary folder as DIR/run-N (what the tests wrote: for
# example the A/B results of tests/ab/test_real_servers.py, which
# benchmarks/ab_false_positive.py --from-results reads).
#
# Exit status: 0 when every run passed, 1 when some test failed at least once, 2 on bad use.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [pytest arguments...]  (N: how many runs, >= 1)" >&2
  exit 2
fi
runs=$1
shift
selection=("$@")
if [[ ${#selection[@]} -eq 0 ]]; then
  selection=(-m slow tests)
fi
python=${PYTHON:-.venv/bin/python}
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
for ((run = 1; run <= runs; run++)); do
  keep=()
  if [[ -n "${KEEP:-}" ]]; then
    mkdir -p "$KEEP"
    keep=(--basetemp="$KEEP/run-$run")
  fi
  "$python" -m pytest -q -p no:cacheprovider --junitxml="$reports/run-$run.xml" \
    "${keep[@]}" "${selection[@]}" >"$reports/run-$run.log" 2>&1
  echo "run $run/$runs: pytest exit $? ($(tail -n 1 "$reports/run-$run.log"))"
done
"$python" - "$reports" "$runs" <<'EOF'
import glob
import sys
import xml.etree.ElementTree as ET
from collections import Counter

folder, runs = sys.argv[1], int(sys.argv[2])
failed, seen = Counter(), set()
for path in sorted(glob.glob(f"{folder}/run-*.xml")):
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        seen.add(name)
        if case.find("failure") is not None or case.find("error") is not None:
            failed[name] += 1
print(f"{len(seen)} tests, {runs} runs")
for name, count in sorted(failed.items()):
    print(f"FLAKY {name}: failed {count} of {runs}")
if not seen:
    print("no test ran: check the arguments")
sys.exit(1 if failed or not seen else 0)
EOF
