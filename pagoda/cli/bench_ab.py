"""`pagoda bench ab`: the same traffic to two or more OpenAI-compatible endpoints, with
confidence intervals and a verdict. This file parses and checks the flags; pagoda/ab/run.py
runs it (pagoda/ab/replay.py sends the traffic, stats.py judges it, report.py writes it).

    pagoda bench ab --endpoint A=http://127.0.0.1:8000 --endpoint B=http://127.0.0.1:8080 \\
        --traffic traffic.jsonl --slo ttft=1s,tpot=100ms --cost A=0.50 --cost B=0.80 \\
        --output ab.json --html ab.html
    pagoda bench ab --from-record proxy.jsonl --html ab.html     # a live split's record

Every check a user can fail comes before the tokenizer, the trace or the traffic.
"""

from __future__ import annotations

import argparse
import math
import os

from pagoda.cli.bench_args import DefaultsHelpFormatter

TRACE_FORMATS = ("pagoda", "sharegpt", "azure", "mooncake")


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "ab", help="A/B: the same traffic to several endpoints, intervals and a verdict",
        formatter_class=DefaultsHelpFormatter)
    e = p.add_argument_group("endpoints")
    e.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                   help="an endpoint to compare (twice or more; the first is the baseline)")
    e.add_argument("--label", action="append", default=[], metavar="NAME=TEXT",
                   help="what an endpoint runs on, for the report (besides what it reports)")
    e.add_argument("--cost", action="append", default=[], metavar="NAME=PRICE",
                   help="an endpoint's price per hour: the report gives cost per million "
                        "output tokens")
    e.add_argument("--model", action="append", default=[], metavar="NAME=MODEL",
                   help="the model name to send to an endpoint (default: its first)")
    e.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for every endpoint (default: $OPENAI_API_KEY)")
    t = p.add_argument_group("traffic")
    t.add_argument("--traffic", default=None,
                   help="the requests to replay: `pagoda serve --record-traffic`'s file, or a "
                        "public trace (--trace-format)")
    t.add_argument("--trace-format", choices=TRACE_FORMATS, default="pagoda",
                   help="pagoda (recorded JSONL), sharegpt (conversations; arrivals from "
                        "--request-rate or 1/s), azure (Azure LLM inference trace CSV), "
                        "mooncake (Mooncake JSONL)")
    t.add_argument("--tokenizer", default=None,
                   help="builds prompts of the trace's token counts (azure, mooncake, sharegpt); "
                        "default: the bundled model's")
    t.add_argument("--max-requests", type=int, default=None, help="replay only the first N")
    t.add_argument("--time-scale", type=float, default=1.0,
                   help="recorded gaps between arrivals times this (0.5: twice as fast)")
    t.add_argument("--request-rate", type=float, default=None,
                   help="conversations start at Poisson times at this rate per second (a "
                        "single request is a conversation; inf: a block's all at once) instead "
                        "of the recorded times; later turns still follow their replies")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    t.add_argument("--block-size", type=int, default=32,
                   help="requests per block; blocks alternate between endpoints (A B, B A, ...)")
    t.add_argument("--repeats", type=int, default=1,
                   help="passes over the whole trace; a pass after the first puts '[pass N] ' "
                        "before each conversation's first message or prompt, so that no prompt "
                        "cache serves it from an earlier pass")
    t.add_argument("--warm-repeats", action="store_true",
                   help="repeat the very same prompts (prompt caches then serve later passes)")
    t.add_argument("--num-warmups", type=int, default=2,
                   help="untimed requests to each endpoint first")
    t.add_argument("--no-match-output-lengths", dest="match_output_lengths",
                   action="store_false",
                   help="send the recorded max_tokens as they are, instead of the recorded "
                        "output length with ignore_eos/min_tokens (vLLM's extras)")
    t.add_argument("--recorded-replies", action="store_true",
                   help="later turns of a chat carry the recorded replies, not the endpoint's "
                        "own (which a real user would have seen)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--from-record", default=None,
                   help="report on `pagoda ab-proxy --record`'s file instead of sending traffic")
    r = p.add_argument_group("report")
    r.add_argument("--slo", default=None,
                   help="goodput bounds, e.g. ttft=500ms,tpot=50ms (keys ttft, tpot, itl, e2el)")
    r.add_argument("--confidence", type=float, default=0.95, help="of every interval")
    r.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    r.add_argument("--calibrate", choices=("auto", "on", "off"), default="auto",
                   help="measure the A/A noise floor from each endpoint's own passes (odd "
                   "against even; needs --repeats 2, or two blocks) and call no difference "
                   "below it; auto: on when every endpoint reports the same hardware")
    r.add_argument("--output", default=None, help="write the requests, analysis and verdict "
                                                  "(JSON) here")
    r.add_argument("--html", default=None, help="write the report (one offline HTML page) here")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_bench_ab)


def parse_named(values: list[str], flag: str, names: list[str] | None = None) -> dict[str, str]:
    """['A=x', 'B=y'] -> {'A': 'x', 'B': 'y'}; names, if given, are the only ones allowed."""
    named: dict[str, str] = {}
    for value in values:
        name, sep, text = value.partition("=")
        name = name.strip()
        if not sep or not name or not text.strip():
            raise ValueError(f"{flag} {value!r}: write NAME=VALUE, e.g. {flag} A=...")
        if name in named:
            raise ValueError(f"{flag}: {name!r} given twice")
        if names is not None and name not in names:
            raise ValueError(f"{flag} {value!r}: no --endpoint is named {name!r} "
                             f"(endpoints: {', '.join(names)})")
        named[name] = text.strip()
    return named


def parse_costs(values: list[str], names: list[str]) -> dict[str, float]:
    costs = {}
    for name, text in parse_named(values, "--cost", names).items():
        try:
            cost = float(text)
        except ValueError:
            raise ValueError(f"--cost {name}={text}: not a number (a price per hour)") from None
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"--cost {name}={text}: must be a price >= 0")
        costs[name] = cost
    return costs


def check_ab_args(args: argparse.Namespace):
    """Every flag checked; returns (endpoints without probing, ReplayConfig, slo)."""
    from pagoda.ab.replay import Endpoint, ReplayConfig
    from pagoda.bench.metrics import parse_slo
    from pagoda.bench.serve import normalize_base_url

    slo = parse_slo(args.slo) if args.slo is not None else None
    if not 0.5 <= args.confidence < 1:
        raise ValueError(f"--confidence must be in [0.5, 1), got {args.confidence}")
    if args.resamples < 100:
        raise ValueError(f"--resamples must be >= 100, got {args.resamples}")
    if args.from_record is not None:
        if args.endpoint or args.traffic:
            raise ValueError("--from-record reports on a recorded run: give no --endpoint or "
                             "--traffic with it")
        if not os.path.isfile(args.from_record):
            raise ValueError(f"--from-record {args.from_record}: no such file")
        return [], None, slo
    urls = parse_named(args.endpoint, "--endpoint")
    if len(urls) < 2:
        raise ValueError("give at least two --endpoint NAME=URL to compare")
    names = list(urls)
    labels = parse_named(args.label, "--label", names)
    models = parse_named(args.model, "--model", names)
    costs = parse_costs(args.cost, names)
    if args.traffic is None:
        raise ValueError("--traffic FILE is needed: the requests to replay (record them with "
                         "`pagoda serve --record-traffic FILE`, or give a public trace with "
                         "--trace-format)")
    if not os.path.isfile(args.traffic):
        raise ValueError(f"--traffic {args.traffic}: no such file")
    if args.max_requests is not None and args.max_requests < 1:
        raise ValueError(f"--max-requests must be >= 1, got {args.max_requests}")
    config = ReplayConfig(
        block_size=args.block_size, repeats=args.repeats, warm_repeats=args.warm_repeats,
        time_scale=args.time_scale,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups, match_output_lengths=args.match_output_lengths,
        recorded_replies=args.recorded_replies, timeout=args.timeout, seed=args.seed)
    endpoints = [Endpoint(name=name, url=normalize_base_url(url), model=models.get(name),
                          label=labels.get(name), cost_per_hour=costs.get(name))
                 for name, url in urls.items()]
    return endpoints, config, slo


def load_traffic(args: argparse.Namespace):
    from pagoda.ab.trace_import import load_trace

    tokenizer = None
    if args.trace_format != "pagoda":
        from pagoda.cli.bench_serve import load_bench_tokenizer

        tokenizer = load_bench_tokenizer(args.tokenizer)
    rate = args.request_rate if args.request_rate and math.isfinite(args.request_rate) else 1.0
    return load_trace(args.traffic, args.trace_format, tokenizer, rate=rate, seed=args.seed,
                      max_requests=args.max_requests)


def run_bench_ab(args: argparse.Namespace) -> int:
    from pagoda.ab import run

    endpoints, config, slo = check_ab_args(args)
    if args.from_record is not None:
        result = run.record_result(args.from_record)
    else:
        entries = load_traffic(args)
        result = run.replay_result(endpoints, entries, config, api_key=args.api_key,
                                   progress=args.progress, run_config=_config(args, len(entries)))
    run.judge_and_report(result, slo, confidence=args.confidence, resamples=args.resamples,
                         seed=args.seed, output=args.output, html=args.html,
                         calibrate={"auto": None, "on": True, "off": False}[args.calibrate])
    return 0


def _config(args: argparse.Namespace, num_entries: int) -> dict:
    config = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
              for k, v in vars(args).items()
              if k not in ("func", "api_key", "command", "bench_command", "log_level")}
    config["num_entries"] = num_entries  # JSON has no inf: --request-rate inf is "inf"
    return config
