"""How often `pagoda bench ab` calls a winner between servers that are the same (A/A).

Starts `pagoda serve` processes on the bundled model, records a trace through one of them
(`--record-traffic`, driven by `pagoda bench serve`), then replays that trace N times in
one of two arrangements:

- `same`:  one server under two names (`--endpoint one=URL --endpoint two=URL`): a pure
  A/A, the noise of one process between its passes;
- `twins`: two processes of one configuration: what a user A/B testing two replicas of
  one deployment runs (start order, memory layout and warm-up differ between them).

The compared servers are started afresh every --restart-every runs (default: every run), so
the runs sample many pairs of processes, not one pair's lasting difference.

Each replay's result (requests and timings) is analysed twice, offline: with the
calibration off and on (pagoda/ab/calibration.py: the A/A noise floor measured from the
run's own passes), and the script prints the rate at which each called a winner. Every
result is kept under --out, so other rules can be tried on the very same replays.

    .venv/bin/python benchmarks/ab_false_positive.py --arrangement twins --runs 20 \\
        --num-requests 32 --input-len 48 --output-len 12 -- \\
        --block-size 8 --request-rate inf --repeats 2 --num-warmups 1

Arguments after `--` go to `pagoda bench ab` as they are. `--from-results FILE...` starts
nothing: it analyses `pagoda bench ab --output` files already written (for example by
`KEEP=DIR benchmarks/flake_check.sh 20 tests/ab/test_real_servers.py -k identical`, whose
every run is a twins A/A on the fixture's traffic) the same two ways.

    .venv/bin/python benchmarks/ab_false_positive.py --arrangement twins \\
        --from-results DIR/run-*/test_identical*/ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(256 * 1024 * 1024),
               "--max-model-len", "2048", "--no-prefix-caching"]
"""The identical-servers test's settings (tests/ab/test_real_servers.py): no prefix cache, so
that a replayed request gets no cheaper prefill on a server that saw it before."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `pagoda serve` process on a free loopback port, ready when constructed."""

    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda", "serve", "--port", str(self.port), *ENGINE_ARGS,
             *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} not ready after 900 s: see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def bench(*args: str) -> None:
    from pagoda.cli.main import main

    if main(list(args)) != 0:
        raise SystemExit(f"pagoda {' '.join(args[:2])} failed")


def summarize(runs: list[dict]) -> dict:
    """Per analysis ('uncalibrated', 'calibrated'): how many runs called a winner, and the
    outcomes and metrics that did."""
    out = {}
    for key in ("uncalibrated", "calibrated"):
        outcomes = [r[key]["outcome"] for r in runs]
        winners = sum(1 for o in outcomes if o != "no_difference")
        out[key] = {"runs": len(runs), "winners_called": winners,
                    "rate": winners / len(runs) if runs else None,
                    "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))}}
    floors = [r["calibrated"]["floor"] for r in runs if r["calibrated"]["floor"] is not None]
    out["calibrated"]["floor_median"] = sorted(floors)[len(floors) // 2] if floors else None
    return out


def analyses(result: dict, analyze) -> dict:
    """The run analysed with and without calibration: outcome, significant metrics, floor."""
    out = {}
    for key, calibrate in (("uncalibrated", False), ("calibrated", True)):
        analysis = analyze(result, resamples=1000, calibrate=calibrate)
        [comparison] = analysis["comparisons"]
        calibration = analysis.get("calibration") or {}
        out[key] = {"outcome": comparison["outcome"],
                    "floor": calibration.get("floor"),
                    "significant": [(m["name"], round(m["difference"], 4))
                                    for m in comparison["metrics"] if m["significant"]]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--arrangement", choices=("same", "twins"), required=True)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--num-requests", type=int, default=32, help="of the recorded trace")
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--max-concurrency", type=int, default=16, help="while recording")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="of the compared servers")
    parser.add_argument("--restart-every", type=int, default=1,
                        help="start the compared servers afresh every N runs (0: never)")
    parser.add_argument("--out", default=None, help="folder for every run's result (default: "
                        "a new temporary folder)")
    parser.add_argument("--from-results", nargs="+", metavar="FILE", help="analyse these "
                        "`pagoda bench ab --output` files instead of running anything")
    args, ab_args = parser.parse_known_args()
    ab_args = [a for a in ab_args if a != "--"]
    from pagoda.ab.stats import analyze

    if args.from_results:
        runs = [{"run": path, **analyses(json.loads(Path(path).read_text()), analyze)}
                for path in args.from_results]
        summary = {"arrangement": args.arrangement, "from_results": len(runs),
                   **summarize(runs), "runs": runs}
        print(json.dumps(summary, indent=1))
        return 0

    out = Path(args.out or tempfile.mkdtemp(prefix="ab-false-positive-"))
    out.mkdir(parents=True, exist_ok=True)
    traffic = out / "traffic.jsonl"
    servers = []
    try:
        # The trace is recorded by a server of its own (one sequence at a time), so that the
        # compared servers are configured alike, recording included.
        recorder = Server(["--max-num-seqs", "1", "--record-traffic", str(traffic)], out,
                          "recorder")
        servers.append(recorder)
        bench("bench", "serve", "--base-url", recorder.url, "--no-progress",
              "--num-warmups", "0", "--num-requests", str(args.num_requests),
              "--input-len", str(args.input_len), "--output-len", str(args.output_len),
              "--max-concurrency", str(args.max_concurrency))
        recorder.stop()
        servers.remove(recorder)
        compared = ["--max-num-seqs", str(args.max_num_seqs)]
        runs = []
        for run in range(args.runs):
            if run == 0 or (args.restart_every and run % args.restart_every == 0):
                for server in servers:
                    server.stop()
                one = Server(compared, out, f"one-{run:02d}")
                servers = [one]
                two = one if args.arrangement == "same" else Server(compared, out, f"two-{run:02d}")
                if two is not one:
                    servers.append(two)
            path = out / f"run-{run:02d}.json"
            bench("bench", "ab", "--no-progress", "--endpoint", f"one={one.url}",
                  "--endpoint", f"two={two.url}", "--traffic", str(traffic),
                  "--resamples", "1000", "--output", str(path), *ab_args)
            runs.append({"run": run, **analyses(json.loads(path.read_text()), analyze)})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.stop()
    summary = {"arrangement": args.arrangement, "restart_every": args.restart_every, "trace": {
        "num_requests": args.num_requests, "input_len": args.input_len,
        "output_len": args.output_len}, "ab_args": ab_args, "cpu_count": os.cpu_count(),
        **summarize(runs), "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
