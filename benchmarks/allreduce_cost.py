"""What an all-reduce costs Pagoda's tensor parallelism here, against the compute it splits.

Method
------
0. Wait until the 1-minute load average is below ``--wait-load`` (the machine is shared),
   and record the load averages at the start, after each run and at the end.

1. All-reduce latency. ``--runs`` times over (each run a fresh pair of processes from
   ``torch.multiprocessing.spawn`` and a fresh ``init_process_group("gloo",
   "tcp://127.0.0.1:PORT")``, world size 2, one torch thread per rank), for every dtype in
   {float32, bfloat16}, hidden in {576 (SmolLM2-135M, the bundled model), 4096 (a 7-8B
   Llama), 8192 (a 70B Llama)} and num_tokens in {1, 8, 64, 512}:

   - a (num_tokens, hidden) tensor, the same values on both ranks;
   - ``--warmup`` untimed all-reduces, then rank 0 picks a repetition count that fills about
     ``--seconds-per-case`` (at least ``--min-reps``, at most ``--max-reps``) and broadcasts it;
   - a barrier, then each rank times every ``dist.all_reduce(t, SUM)`` alone with
     ``time.perf_counter_ns`` (the call is synchronous on CPU); between calls, outside the
     timed region, ``t *= 0.5`` undoes the doubling so the values stay finite (exact in
     both dtypes);
   - per repetition the slower rank's time counts (the collective is done when both are);
     the report gives its median, 90th percentile and mean in microseconds, and the bus
     bandwidth 2 (n - 1) / n x bytes / median time, NCCL-tests' "busbw" (n = 2: bytes / time).
   Each figure in the summary is the median over runs of the runs' figures, with the runs'
   min..max beside it.

2. Compute that TP=2 would split. In the parent process, after the all-reduce runs,
   float32 ``F.linear`` over one SmolLM2-135M layer's four matmuls (qkv 576->960, o 576->576,
   gate_up 576->3072, down 1536->576), median of ``--compute-reps``: at TP=1 with 2 threads
   (how Pagoda runs TP=1 here), at TP=1 with 1 thread, and over the larger rank's shard at
   TP=2 with 1 thread (a TP=2 rank's share of this 2-core machine). The TP=2 shard is the
   Megatron split: column-parallel qkv and gate_up, row-parallel o and down; 9 query and 3
   KV heads do not divide by 2, and Pagoda's partition (pagoda/executor/parallel/partition.py)
   splits by KV head, 2 + 1, so the larger rank holds 6 query and 2 KV heads: qkv 576->640,
   o 384->576, gate_up 576->1536, down 768->576. For num_tokens 1 (decode) and 64.
   Attention, norms, the logits head and the sampler are left out.

3. A floor: the round trip of 2,304 bytes (one token's float32 hidden state) each way over
   TCP loopback between two processes, plain sockets, no gloo (benchmarks/tcp_round_trip.py).

4. The TP=2 estimate for SmolLM2-135M's 30 layers: 30 x a rank's matmuls + 60 all-reduces
   of (num_tokens, 576) float32 (Pagoda's activations on this CPU), and the all-reduces'
   share of that, once with the all-reduce's median and once with its mean.

The paper half of BENCHMARKS.md's distributed-inference section (GPUs, which this machine
lacks) is benchmarks/parallel_model.py.

Output: JSON to ``--out`` (host, load averages, every run's numbers, the spread across runs)
and a table on stdout.

    python benchmarks/allreduce_cost.py --out benchmarks/results/DATE-allreduce/allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tcp_round_trip import measure_tcp_round_trip, percentile  # (benchmarks/, beside this)

WORLD_SIZE = 2
HIDDENS = (576, 4096, 8192)
NUM_TOKENS = (1, 8, 64, 512)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# SmolLM2-135M (read from the bundled GGUF): 30 layers, hidden 576, MLP 1536, 9 heads,
# 3 KV heads, head_dim 64.
SMOL_LAYERS = 30
SMOL_HIDDEN = 576
# (in_features, out_features) of each matmul in one layer.
SMOL_TP1_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
# The larger TP=2 rank, as pagoda/executor/parallel/partition.py splits the heads: 3 KV heads
# over 2 ranks go 2 + 1, each with its 3 query heads, so rank 0 holds 6 query and 2 KV heads.
SMOL_TP2_SHAPES = {"qkv": (576, 640), "o": (384, 576), "gate_up": (576, 1536), "down": (768, 576)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _time_one_case(rank: int, num_tokens: int, hidden: int, dtype: torch.dtype,
                   args: argparse.Namespace) -> list[float]:
    """Per-repetition all-reduce times in microseconds on this rank."""
    generator = torch.Generator().manual_seed(num_tokens * 100003 + hidden)
    tensor = torch.randn(num_tokens, hidden, generator=generator).to(dtype)  # same on both ranks
    warmup_ns = []
    for _ in range(args.warmup):
        start = time.perf_counter_ns()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        warmup_ns.append(time.perf_counter_ns() - start)
        tensor.mul_(0.5)
    reps = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        per_call_s = statistics.median(warmup_ns) / 1e9
        reps[0] = int(min(args.max_reps, max(args.min_reps, args.seconds_per_case / per_call_s)))
    dist.broadcast(reps, src=0)
    times_us = []
    dist.barrier()
    for _ in range(int(reps.item())):
        start = time.perf_counter_ns()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        times_us.append((time.perf_counter_ns() - start) / 1e3)
        tensor.mul_(0.5)
    return times_us


def tensor_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _worker(rank: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD_SIZE)
    cases = []
    for dtype_name, dtype in DTYPES.items():
        for hidden in HIDDENS:
            for num_tokens in NUM_TOKENS:
                times_us = _time_one_case(rank, num_tokens, hidden, dtype, args)
                # The collective ends when the slower rank's call returns:
                # keep, per repetition, the max.
                mine = torch.tensor(times_us, dtype=torch.float64)
                gathered = [torch.empty_like(mine) for _ in range(WORLD_SIZE)]
                dist.all_gather(gathered, mine)
                slowest = torch.stack(gathered).max(dim=0).values.tolist()
                num_bytes = num_tokens * hidden * tensor_itemsize(dtype)
                median_us = statistics.median(slowest)
                cases.append({
                    "dtype": dtype_name, "hidden": hidden, "num_tokens": num_tokens,
                    "bytes": num_bytes, "reps": len(slowest),
                    "median_us": median_us, "p90_us": percentile(slowest, 90),
                    "mean_us": statistics.fmean(slowest), "min_us": min(slowest),
                    "busbw_GBps": (2 * (WORLD_SIZE - 1) / WORLD_SIZE * num_bytes
                                   / (median_us * 1e-6) / 1e9),
                })
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(cases))


def run_allreduce_sweep(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "cases.json")
        mp.spawn(_worker, args=(_free_port(), args, result_path), nprocs=WORLD_SIZE, join=True)
        return json.loads(Path(result_path).read_text())


def _time_linear_us(num_tokens: int, in_features: int, out_features: int, reps: int) -> float:
    """Median microseconds of one float32 F.linear (num_tokens, in) x (out, in)^T."""
    x = torch.randn(num_tokens, in_features)
    weight = torch.randn(out_features, in_features)
    for _ in range(5):
        F.linear(x, weight)
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        F.linear(x, weight)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def measure_layer_compute(reps: int) -> list[dict]:
    rows = []
    setups = [("TP=1, 2 threads", SMOL_TP1_SHAPES, 2),
              ("TP=1, 1 thread", SMOL_TP1_SHAPES, 1),
              ("TP=2 rank (larger shard), 1 thread", SMOL_TP2_SHAPES, 1)]
    saved_threads = torch.get_num_threads()
    try:
        for num_tokens in (1, 64):
            for label, shapes, threads in setups:
                torch.set_num_threads(threads)
                per_matmul = {name: _time_linear_us(num_tokens, fan_in, fan_out, reps)
                              for name, (fan_in, fan_out) in shapes.items()}
                rows.append({"setup": label, "threads": threads, "num_tokens": num_tokens,
                             "matmul_us": per_matmul, "layer_us": sum(per_matmul.values())})
    finally:
        torch.set_num_threads(saved_threads)
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[list[dict]]) -> list[dict]:
    """One row per case: the median over runs of each run's median, and the runs' min..max."""
    summary = []
    for index, case in enumerate(runs[0]):
        medians = [run[index]["median_us"] for run in runs]
        p90s = [run[index]["p90_us"] for run in runs]
        means = [run[index]["mean_us"] for run in runs]
        busbws = [run[index]["busbw_GBps"] for run in runs]
        summary.append({key: case[key] for key in ("dtype", "hidden", "num_tokens", "bytes")}
                       | {"median_us": _spread(medians), "p90_us": _spread(p90s),
                          "mean_us": _spread(means),
                          "busbw_GBps": _spread(busbws)})
    return summary


def tp2_estimate(summary: list[dict], compute: list[dict]) -> list[dict]:
    """SmolLM2-135M at TP=2, 30 layers x (a rank's matmuls + 2 all-reduces), per num_tokens.

    Once with the all-reduce's median and once with its mean: a step pays the sum of its 60
    calls, so over many steps the mean (tail included) is what a step costs."""
    rows = []
    for num_tokens in (1, 64):
        allreduce = next(row for row in summary if row["dtype"] == "float32"
                         and row["hidden"] == SMOL_HIDDEN and row["num_tokens"] == num_tokens)
        by_setup = {row["setup"]: row["layer_us"]
                    for row in compute if row["num_tokens"] == num_tokens}
        tp2_matmuls_ms = SMOL_LAYERS * by_setup["TP=2 rank (larger shard), 1 thread"] / 1e3
        for statistic in ("median", "mean"):
            allreduce_us = allreduce[f"{statistic}_us"]["median"]
            allreduces_ms = SMOL_LAYERS * 2 * allreduce_us / 1e3
            tp2_ms = tp2_matmuls_ms + allreduces_ms
            rows.append({
                "num_tokens": num_tokens,
                "allreduce_statistic": statistic,
                "allreduce_us": allreduce_us,
                "allreduces_per_step_ms": allreduces_ms,
                "tp1_2threads_matmuls_ms": SMOL_LAYERS * by_setup["TP=1, 2 threads"] / 1e3,
                "tp1_1thread_matmuls_ms": SMOL_LAYERS * by_setup["TP=1, 1 thread"] / 1e3,
                "tp2_rank_matmuls_ms": tp2_matmuls_ms,
                "tp2_step_ms": tp2_ms,
                "allreduce_fraction_of_tp2_step": allreduces_ms / tp2_ms,
            })
    return rows


def wait_for_idle(max_load: float, max_wait_s: float) -> float:
    """Wait until the 1-minute load average is below max_load (or max_wait_s passes)."""
    began = time.monotonic()
    while _loadavg()[0] >= max_load and time.monotonic() - began < max_wait_s:
        time.sleep(5)
    return time.monotonic() - began


def host_info() -> dict:
    flags = set()
    model_name = ""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and not model_name:
                model_name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags.update(flag for flag in line.split(":", 1)[1].split()
                             if flag.startswith(("avx", "amx", "fma", "f16c")))
    return {"cpu": model_name, "cpu_flags": sorted(flags), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "gloo_available": dist.is_gloo_available()}


def _loadavg() -> list[float]:
    return [float(value) for value in Path("/proc/loadavg").read_text().split()[:3]]


def format_report(report: dict) -> str:
    host = report["host"]
    lines = [
        (f"host: {host['cpu']}, {host['cpus']} CPUs, flags {' '.join(host['cpu_flags'])}, "
        f"torch {host['torch']}"),
        (f"gloo, tcp://127.0.0.1, {WORLD_SIZE} processes x 1 thread, {len(report['runs'])} runs; "
        f"load average at start {report['load_average_at_start']}, "
        f"after each run {report['load_average_after_each_run']}"),
        "",
        "all_reduce(SUM): the median over runs of each run's median [runs' min..max];",
        "p90 and mean likewise; busbw = 2(n-1)/n x bytes / median",
        (f"{'dtype':<9} {'hidden':>6} {'tokens':>6} {'bytes':>9}  {'median us':>24}  "
        f"{'p90 us':>24}  {'mean us':>8}  {'busbw GB/s':>10}"),
    ]
    for row in report["summary"]:
        med, p90 = row["median_us"], row["p90_us"]
        lines.append(
            f"{row['dtype']:<9} {row['hidden']:>6} {row['num_tokens']:>6} {row['bytes']:>9}  "
            f"{med['median']:>8.1f} [{med['min']:>7.1f}..{med['max']:>7.1f}]  "
            f"{p90['median']:>8.1f} [{p90['min']:>7.1f}..{p90['max']:>7.1f}]  "
            f"{row['mean_us']['median']:>8.1f}  {row['busbw_GBps']['median']:>10.3f}")
    lines += ["", "SmolLM2-135M, one layer's four float32 matmuls (F.linear), median us",
              (f"{'setup':<36} {'tokens':>6} {'qkv':>8} {'o':>8} {'gate_up':>8} {'down':>8} "
              f"{'layer':>8}")]
    for row in report["layer_compute"]:
        mm = row["matmul_us"]
        lines.append(f"{row['setup']:<36} {row['num_tokens']:>6} {mm['qkv']:>8.1f} {mm['o']:>8.1f} "
                     f"{mm['gate_up']:>8.1f} {mm['down']:>8.1f} {row['layer_us']:>8.1f}")
    rtt = report["tcp_round_trip"]
    lines += ["", (f"floor: TCP loopback round trip of {rtt['bytes']} bytes each way between two "
                   f"processes (no gloo): median {rtt['median_us']:.1f} us, "
                   f"p90 {rtt['p90_us']:.1f} us, "
                   f"mean {rtt['mean_us']:.1f} us")]
    lines += ["", ("SmolLM2-135M at TP=2, 30 layers: a rank's matmuls + 60 float32 all-reduces "
                   "of (tokens, 576)"),
              (f"{'tokens':>6} {'AR stat':>7} {'AR us':>7} {'60 AR ms':>9} {'TP1 2thr ms':>11} "
              f"{'TP1 1thr ms':>11} {'TP2 rank ms':>11} {'TP2 step ms':>11} {'AR share':>8}")]
    for row in report["tp2_estimate"]:
        lines.append(
            f"{row['num_tokens']:>6} {row['allreduce_statistic']:>7} {row['allreduce_us']:>7.1f} "
            f"{row['allreduces_per_step_ms']:>9.2f} {row['tp1_2threads_matmuls_ms']:>11.2f} "
            f"{row['tp1_1thread_matmuls_ms']:>11.2f} {row['tp2_rank_matmuls_ms']:>11.2f} "
            f"{row['tp2_step_ms']:>11.2f} {row['allreduce_fraction_of_tp2_step']:>8.0%}")
    lines.append(f"load average at end {report['load_average_at_end']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--runs", type=int, default=3,
                        help="independent sweeps, each a fresh process group")
    parser.add_argument("--warmup", type=int, default=10, help="untimed all-reduces per case")
    parser.add_argument("--seconds-per-case", type=float, default=0.3,
                        help="aim for about this much timed all-reduce per case")
    parser.add_argument("--min-reps", type=int, default=20)
    parser.add_argument("--max-reps", type=int, default=2000)
    parser.add_argument("--compute-reps", type=int, default=100,
                        help="repetitions per timed matmul")
    parser.add_argument("--wait-load", type=float, default=1.0,
                        help="start once the 1-minute load average is below this (0: do not wait)")
    parser.add_argument("--wait-max", type=float, default=300.0,
                        help="give up waiting after this many seconds")
    args = parser.parse_args()

    waited_s = wait_for_idle(args.wait_load, args.wait_max) if args.wait_load > 0 else 0.0

    report = {"host": host_info(), "load_average_at_start": _loadavg(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
              "world_size": WORLD_SIZE, "backend": "gloo", "init_method": "tcp://127.0.0.1",
              "waited_for_idle_s": waited_s}
    report["runs"] = []
    report["load_average_after_each_run"] = []
    for run_index in range(args.runs):
        began = time.perf_counter()
        report["runs"].append(run_allreduce_sweep(args))
        report["load_average_after_each_run"].append(_loadavg())
        print(f"run {run_index + 1}/{args.runs}: {time.perf_counter() - began:.1f} s, "
              f"load average {_loadavg()}", flush=True)
    report["summary"] = summarize(report["runs"])
    report["layer_compute"] = measure_layer_compute(args.compute_reps)
    report["tcp_round_trip"] = measure_tcp_round_trip(num_bytes=SMOL_HIDDEN * 4)
    report["tp2_estimate"] = tp2_estimate(report["summary"], report["layer_compute"])
    report["load_average_at_end"] = _loadavg()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(format_report(report), flush=True)


if __name__ == "__main__":
    main()
