"""Issue 38's goals on Ray Serve (BENCHMARKS.md; on a 2-core CPU machine these are mechanics,
not speed): `pagoda serve --ray-serve` on a two-node ray.cluster_utils cluster on this
machine (or --ray-address), greedy streamed completions from a load whose concurrency this
script sets, and three phases:

  ramp     1 -> 16 concurrent streams over --ramp-s seconds, --hold-s at 16, back to 1 over
           --ramp-s, then idle: replicas must go 1 -> max -> 1 with zero failed requests, and
           the P95 TTFT of requests sent in the --after-s seconds after the replica count
           reached max within 2x of the P95 TTFT of the hold's last half (steady state);
  kill     16 streams, both replicas up: one replica's actor killed; failed requests must be
           <= its in-flight streams at the kill, and full capacity back within 60 s;
  upgrade  --upgrade-concurrency streams: a rolling upgrade (another --kv-cache-memory) must
           fail no request.

    PYTHONPATH=. .venv/bin/python benchmarks/ray_serve_goals.py --output goals.json \
        [--model PATH] [--max-replicas 2] [--ray-address ADDR]

Prints one JSON object (also written to --output): per phase the numbers and a "pass".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import ray

from tests.deploy.serve_load import Load, engine_replica_actor, running_replicas
from tests.entrypoints.server_helpers import RemoteServer

FAST_METRICS_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


def p95(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))] if values else None


class ReplicaTimeline(threading.Thread):
    """(seconds since start, RUNNING engine replicas) once a second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.start_time = time.monotonic()
        self.points: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.points.append((round(time.monotonic() - self.start_time, 1),
                                running_replicas()))
            time.sleep(1)

    def first_time_at(self, count: int, after: float = 0.0) -> float | None:
        return next((self.start_time + t for t, n in self.points if n >= count and t >= after),
                    None)


def ramp_phase(url: str, args, timeline: ReplicaTimeline) -> dict:
    load = Load(url, 1, max_concurrency=16, model="pagoda", max_tokens=args.max_tokens)
    with load:
        step = args.ramp_s / 15
        for c in range(1, 17):
            load.concurrency = c
            time.sleep(step)
        hold_start = time.monotonic()
        time.sleep(args.hold_s)
        hold_end = time.monotonic()
        for c in range(16, 0, -1):
            load.concurrency = c
            time.sleep(step)
        outcomes = load.stop()
    idle_start = time.monotonic()
    while running_replicas() > 1 and time.monotonic() - idle_start < args.idle_timeout_s:
        time.sleep(1)
    reached_max = timeline.first_time_at(args.max_replicas)
    counts = [n for _, n in timeline.points]
    steady = [o.ttft for o in outcomes if o.ttft is not None
              and (hold_start + hold_end) / 2 <= o.start <= hold_end]
    after = [o.ttft for o in outcomes if o.ttft is not None and reached_max is not None
             and reached_max <= o.start <= reached_max + args.after_s]
    failed = [o.error for o in outcomes if o.error is not None]
    result = {
        "requests": len(outcomes), "failed": len(failed), "errors": failed[:10],
        "max_replicas_seen": max(counts, default=0),
        "replicas_at_end": running_replicas(),
        "p95_ttft_steady_s": p95(steady), "p95_ttft_after_scale_up_s": p95(after),
        "seconds_back_to_1_replica_after_ramp": round(time.monotonic() - idle_start, 1),
    }
    result["pass"] = (not failed and result["max_replicas_seen"] == args.max_replicas
                      and result["replicas_at_end"] == 1 and bool(steady) and bool(after)
                      and result["p95_ttft_after_scale_up_s"]
                      <= 2 * result["p95_ttft_steady_s"])
    return result


def kill_phase(url: str, args) -> dict:
    with Load(url, 16, model="pagoda", max_tokens=args.max_tokens) as load:
        deadline = time.monotonic() + 300
        while (running_replicas() < 2 or len(set(load.open_streams.values())) < 2) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        victim = next(iter(load.open_streams.values()))
        in_flight = list(load.open_streams.values()).count(victim)
        before = len(load.outcomes)
        killed_at = time.monotonic()
        ray.kill(engine_replica_actor(victim), no_restart=True)
        time.sleep(2)  # Serve notices the death
        while running_replicas() < 2 and time.monotonic() - killed_at < 300:
            time.sleep(0.5)
        recovered_s = time.monotonic() - killed_at
        time.sleep(10)
        outcomes = load.stop()
    failed = [o for o in outcomes if o.error is not None]
    return {"requests": len(outcomes), "requests_before_kill": before,
            "victim_in_flight": in_flight, "failed": len(failed),
            "failed_mid_stream_on_victim": sum(o.replica == victim for o in failed),
            "errors": [o.error for o in failed][:10],
            "seconds_to_full_capacity": round(recovered_s, 1),
            "pass": len(failed) <= in_flight and recovered_s <= 60}


def upgrade_phase(url: str, args, flags: list[str], port: int) -> dict:
    from ray import serve

    from pagoda.deploy.app import parse_serve_args
    from pagoda.deploy.application import application
    from pagoda.entrypoints.openai.api_server import build_server_state

    with Load(url, args.upgrade_concurrency, model="pagoda", max_tokens=args.max_tokens) as load:
        time.sleep(10)
        new = parse_serve_args([*flags, "--port", str(port), "--kv-cache-memory",
                                str(200 * 1024 * 1024)])
        started = time.monotonic()
        serve.run(application(new, build_server_state), name="pagoda", route_prefix="/",
                  blocking=False)
        took = time.monotonic() - started
        time.sleep(10)
        outcomes = load.stop()
    failed = [o.error for o in outcomes if o.error is not None]
    return {"requests": len(outcomes), "failed": len(failed), "errors": failed[:10],
            "rollout_s": round(took, 1), "pass": not failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--ray-address", default=None,
                        help="a running cluster (default: a two-node one on this machine)")
    parser.add_argument("--node-cpus", type=int, default=2)
    parser.add_argument("--ramp-s", type=float, default=180)
    parser.add_argument("--hold-s", type=float, default=60)
    parser.add_argument("--after-s", type=float, default=30)
    parser.add_argument("--idle-timeout-s", type=float, default=300)
    parser.add_argument("--upgrade-concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--phases", default="ramp,kill,upgrade")
    args = parser.parse_args()
    os.environ.update(FAST_METRICS_ENV)
    cluster = None
    address = args.ray_address
    if address is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus})
        cluster.add_node(num_cpus=args.node_cpus)
        address = cluster.address
    flags = ([] if args.model is None else ["--model", args.model]) + [
        "--served-model-name", "pagoda", "--ray-serve", "--proxy-location", "HeadOnly",
        "--min-replicas", "1", "--max-replicas", str(args.max_replicas),
        "--target-ongoing-requests", "6", "--max-ongoing-requests", "16",
        "--upscale-delay", "5", "--downscale-delay", "30", "--autoscale-look-back", "10",
        "--replica-cpus", "1", "--health-check-period", "2", "--shutdown-timeout", "60",
        "--assign-timeout", "60", "--log-level", "INFO"]
    server = RemoteServer([*flags, "--ray-address", address], startup_timeout=600)
    ray.init(address=address)
    timeline = ReplicaTimeline()
    timeline.start()
    report: dict = {"flags": flags}
    try:
        for phase in args.phases.split(","):
            print(f"phase {phase} ...", file=sys.stderr, flush=True)
            if phase == "ramp":
                report["ramp"] = ramp_phase(server.url, args, timeline)
            elif phase == "kill":
                report["kill"] = kill_phase(server.url, args)
            elif phase == "upgrade":
                report["upgrade"] = upgrade_phase(server.url, args, flags, server.port)
            print(json.dumps(report.get(phase)), file=sys.stderr, flush=True)
    finally:
        timeline.stop.set()
        report["replica_timeline"] = timeline.points
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
        server.stop(timeout=120)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(json.dumps({k: v for k, v in report.items() if k != "replica_timeline"}, indent=1))
    return 0 if all(report.get(p, {}).get("pass") for p in args.phases.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
