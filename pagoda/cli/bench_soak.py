"""`pagoda bench soak`: a long mixed load against a running server that checks it loses
nothing and leaks nothing (pagoda/bench/soak.py). Exit 0 when every check passes, 1 when
one fails (the problems are printed), 2 for a bad flag."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from pagoda.cli.bench_args import DefaultsHelpFormatter
from pagoda.cli.bench_serve import DEFAULT_BASE_URL


def register(bench_subparsers) -> None:
    soak = bench_subparsers.add_parser(
        "soak", help="a long mixed load that checks outputs, leaks and memory",
        formatter_class=DefaultsHelpFormatter)
    soak.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server")
    soak.add_argument("--model", default=None, help="model name to send (default: none sent)")
    soak.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="bearer token (default: $OPENAI_API_KEY)")
    soak.add_argument("--num-requests", type=int, default=200, help="requests in all")
    soak.add_argument("--max-concurrency", type=int, default=16, help="most requests in flight")
    soak.add_argument("--seed", type=int, default=0, help="seeds the workload")
    soak.add_argument("--timeout", type=float, default=300.0,
                      help="seconds after which a request counts as hung")
    soak.add_argument("--warmup-fraction", type=float, default=0.2,
                      help="RSS is compared with its value once this fraction has finished")
    soak.add_argument("--max-rss-growth", type=float, default=0.05,
                      help="largest RSS growth after the warm-up that passes")
    soak.add_argument("--sample-every", type=float, default=2.0,
                      help="seconds between RSS samples")
    soak.add_argument("--output", default=None, help="write the report (JSON) here")
    soak.add_argument("--plot", default=None, help="write the RSS curve (PNG) here")
    soak.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar")
    soak.add_argument("--no-embeddings", dest="embeddings", action="store_false",
                      help="leave embedding requests out (a server without /v1/embeddings)")
    soak.set_defaults(func=run_bench_soak)


def check_soak_args(args: argparse.Namespace) -> None:
    for name in ("num_requests", "max_concurrency", "timeout", "sample_every"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                             f"{getattr(args, name)}")
    if not 0 < args.warmup_fraction < 1:
        raise ValueError(f"--warmup-fraction must be in (0, 1), got {args.warmup_fraction}")
    if not args.max_rss_growth > 0:
        raise ValueError(f"--max-rss-growth must be positive, got {args.max_rss_growth}")


def run_bench_soak(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagoda.bench.soak import plot_rss, run_soak

    check_soak_args(args)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    with tqdm(total=args.num_requests, desc="soak", unit="req",
              disable=not args.progress) as bar:
        report = asyncio.run(run_soak(
            base_url, args.num_requests, args.max_concurrency, args.seed, args.model,
            args.api_key, args.timeout, args.warmup_fraction, args.sample_every,
            args.max_rss_growth, progress=lambda done, total: bar.update(done - bar.n),
            embeddings=args.embeddings))
    result = report.to_json()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_rss(report, args.plot)
    print(f"{report.num_requests} requests in {report.duration_s:.0f} s: {report.outcomes}; "
          f"{report.num_greedy_checked} greedy choices, {report.num_shaped_checked} tool-call "
          f"and JSON answers and {report.num_embeddings_checked} embeddings checked; "
          f"{report.num_preemptions:g} "
          f"preemptions; RSS {report.rss_after_warmup / 2**20:.0f} -> "
          f"{report.rss_after_drain / 2**20:.0f} MiB ({report.rss_growth:+.1%})")
    for error, count in sorted(report.errors.items(), key=lambda item: -item[1]):
        print(f"  {count} x {error}")
    problems = report.problems()
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0
