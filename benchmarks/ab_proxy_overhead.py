"""What `pagoda ab-proxy` costs the users: the P50 TTFT it adds to the primary's and the CPU it
burns, at 16 concurrent streams (issue 36's goal: <= 2 ms and <= 5% CPU).

The same kind of traffic (`pagoda bench serve`'s random workload, every block its own prompts)
goes straight to the primary (A) and through the proxy (B) in alternating blocks A B A B ...,
so that drift on a shared machine lands on both. The proxy runs in a process of its own,
recording (--record) and mirroring (or --split) to the candidate; its CPU is read from
/proc (psutil if installed) over each B block: CPU seconds / wall seconds, in % of one core.

    python benchmarks/ab_proxy_overhead.py --fake-upstream            # the proxy alone
    python benchmarks/ab_proxy_overhead.py --primary URL --candidate URL --model NAME

--fake-upstream starts two fake OpenAI servers (tests/helpers/fake_server.py: no model, a chunk
every --fake-delay s, the first one at once), so TTFT is HTTP and proxy time only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagoda.bench.client import RequestOptions
from pagoda.bench.datasets import random_dataset
from pagoda.bench.serve import TrafficConfig, run_traffic

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            if process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.1)


def start_fake(delay: float) -> tuple[str, subprocess.Popen]:
    port = free_port()
    code = ("import uvicorn; from tests.helpers.fake_server import build_app; "
            f"uvicorn.run(build_app({delay}), host='127.0.0.1', port={port}, "
            "log_level='critical')")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/v1/models", process, "the fake server")
    return url, process


def start_proxy(args, record: str | None) -> tuple[str, subprocess.Popen]:
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "ab-proxy", "--primary", args.primary,
               "--candidate", args.candidate, "--port", str(port)]
    command += ["--split", str(args.split)] if args.split else ["--mirror"]
    if record:
        command += ["--record", record]
    process = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/ab-proxy/stats", process, "the proxy")
    return url, process


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process so far."""
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except ImportError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_block(url: str, conversations, options, concurrency: int):
    """(successful TTFTs in s, chunks received, wall s) of one block of traffic."""
    records, duration = asyncio.run(run_traffic(
        url, conversations, options, TrafficConfig(max_concurrency=concurrency),
        show_progress=False))
    failed = [r for r in records if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests to {url} failed, e.g. {failed[0].error}")
    return [r.ttft for r in records], sum(len(r.chunk_times) for r in records), duration


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake-upstream", action="store_true",
                   help="start two fake servers as primary and candidate")
    p.add_argument("--fake-delay", type=float, default=0.05,
                   help="seconds between the fake servers' chunks (0.05: 20 tokens/s a stream)")
    p.add_argument("--primary", help="URL of a running primary")
    p.add_argument("--candidate", help="URL of a running candidate")
    p.add_argument("--model", default=None, help="model name to send (real servers)")
    p.add_argument("--split", type=float, default=None,
                   help="run the proxy with --split F instead of --mirror")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="run the proxy without --record")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64, help="requests per block")
    p.add_argument("--blocks", type=int, default=3, help="A/B pairs of blocks")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output", default=None, help="write the figures here (JSON)")
    args = p.parse_args()
    if args.fake_upstream == bool(args.primary and args.candidate):
        p.error("give --fake-upstream, or both --primary and --candidate")

    from pagoda.cli.bench_serve import load_bench_tokenizer

    tokenizer = load_bench_tokenizer(None)
    processes = []
    folder = tempfile.mkdtemp(prefix="ab-proxy-overhead-")
    record = os.path.join(folder, "record.jsonl") if args.record else None
    try:
        if args.fake_upstream:
            for side in ("primary", "candidate"):
                url, process = start_fake(args.fake_delay)
                processes.append(process)
                setattr(args, side, url)
        primary_pid = processes[0].pid if args.fake_upstream else None
        proxy_url, proxy = start_proxy(args, record)
        processes.append(proxy)
        options = RequestOptions(model=args.model, temperature=0.0, ignore_eos=True)
        warm = random_dataset(tokenizer, args.concurrency, args.input_len, 8, 0.0, 10_000)
        run_block(args.primary, warm, options, args.concurrency)
        run_block(proxy_url, warm, options, args.concurrency)
        direct_ttfts, proxied_ttfts, blocks = [], [], []
        cpu_total = wall_total = 0.0
        chunks_total = 0
        for i in range(args.blocks):
            for side, url in (("direct", args.primary), ("proxy", proxy_url)):
                conversations = random_dataset(tokenizer, args.num_requests, args.input_len,
                                               args.output_len, 0.0, seed=2 * i + (side == "proxy"))
                cpu_before = cpu_seconds(proxy.pid)
                primary_before = cpu_seconds(primary_pid) if primary_pid else 0.0
                ttfts, chunks, wall = run_block(url, conversations, options, args.concurrency)
                cpu = cpu_seconds(proxy.pid) - cpu_before
                primary_cpu = cpu_seconds(primary_pid) - primary_before if primary_pid else None
                (direct_ttfts if side == "direct" else proxied_ttfts).extend(ttfts)
                block = {"side": side, "p50_ttft_ms": 1e3 * statistics.median(ttfts),
                         "wall_s": wall, "chunks_per_s": chunks / wall,
                         "proxy_cpu_percent": 100 * cpu / wall,
                         "fake_primary_cpu_percent": primary_cpu and 100 * primary_cpu / wall}
                if side == "proxy":
                    cpu_total, wall_total, chunks_total = (cpu_total + cpu, wall_total + wall,
                                                           chunks_total + chunks)
                blocks.append(block)
                print(f"block {i} {side:6}: P50 TTFT {block['p50_ttft_ms']:6.2f} ms, "
                      f"{block['chunks_per_s']:6.0f} chunks/s, proxy CPU "
                      f"{block['proxy_cpu_percent']:5.1f}% of a core" + (
                          f", fake primary's {block['fake_primary_cpu_percent']:5.1f}%"
                          if primary_pid else ""), flush=True)
        stats = httpx.get(proxy_url + "/ab-proxy/stats").json()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(20)
        shutil.rmtree(folder, ignore_errors=True)
    direct, proxied = statistics.median(direct_ttfts), statistics.median(proxied_ttfts)
    pair_diffs = [b["p50_ttft_ms"] - a["p50_ttft_ms"] for a, b in zip(blocks[::2], blocks[1::2])]
    primary_direct = [b["fake_primary_cpu_percent"] for b in blocks if b["side"] == "direct"]
    result = {
        "config": {k: v for k, v in vars(args).items()},
        "p50_ttft_direct_ms": 1e3 * direct, "p50_ttft_proxied_ms": 1e3 * proxied,
        "p50_ttft_added_ms": 1e3 * (proxied - direct),
        "p50_ttft_added_per_pair_ms": pair_diffs,
        "p50_ttft_added_median_of_pairs_ms": statistics.median(pair_diffs),
        "proxy_cpu_percent_of_a_core": 100 * cpu_total / wall_total,
        "chunks_per_s_through_proxy": chunks_total / wall_total,
        "fake_primary_cpu_percent_direct": statistics.mean(primary_direct)
        if primary_pid else None,
        "proxy_stats": stats, "blocks": blocks,
    }
    print(f"\nP50 TTFT: direct {result['p50_ttft_direct_ms']:.2f} ms, through the proxy "
          f"{result['p50_ttft_proxied_ms']:.2f} ms: +{result['p50_ttft_added_ms']:.2f} ms "
          f"(per A/B pair: {', '.join(f'{d:+.2f}' for d in pair_diffs)} ms; median "
          f"{result['p50_ttft_added_median_of_pairs_ms']:+.2f})")
    print(f"proxy CPU: {result['proxy_cpu_percent_of_a_core']:.1f}% of one core at "
          f"{args.concurrency} streams, {result['chunks_per_s_through_proxy']:.0f} chunks/s "
          f"relayed ({'split' if args.split else 'mirror'}"
          f"{', recording' if args.record else ''}); shadows sent {stats['shadows_sent']}, "
          f"dropped {stats['shadows_dropped']}, failed {stats['shadows_failed']}")
    if primary_pid:
        print(f"(for scale: the fake primary itself, serving the direct blocks: "
              f"{result['fake_primary_cpu_percent_direct']:.1f}% of one core)")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
