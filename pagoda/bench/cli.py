"""`pagoda bench serve | throughput | latency | compare`.

Values a user can get wrong (--slo, --request-rate, an unreachable --base-url, ...) raise
ValueError, which `pagoda.entrypoints.cli.main` prints as one line before exiting with 2.
Everything slow (tokenizer, model, traffic) starts only after all arguments are checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

from pagoda.bench import BenchError
from pagoda.bench.datasets import BUILTIN_DATASETS, DEFAULT_OUTPUT_LEN

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_bench_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks: serving, offline throughput, latency")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="load an OpenAI-compatible server and measure it",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    throughput = sub.add_parser("throughput", help="offline engine throughput on a fixed workload",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(throughput, num_prompts=True)
    throughput.add_argument("--output", default=None, help="write the result JSON here")
    throughput.add_argument("--label", default=None, help="name of this run in `bench compare`")
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_throughput)

    latency = sub.add_parser("latency", help="single-request prefill time and decode speed",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(latency, num_prompts=False)
    latency.add_argument("--num-iters", type=int, default=5, help="measured requests")
    latency.add_argument("--num-warmup-iters", type=int, default=1, help="untimed requests first")
    latency.add_argument("--output", default=None, help="write the result JSON here")
    latency.add_argument("--label", default=None, help="name of this run in `bench compare`")
    add_engine_args(latency)
    latency.set_defaults(func=cmd_latency)

    compare = sub.add_parser("compare", help="one markdown table (and figure) of several results")
    compare.add_argument("results", nargs="+",
                         help="result JSON files; ratios are to the first file (run by run for "
                              "sweeps)")
    compare.add_argument("--labels", default=None,
                         help="comma-separated column names (default: each file's label or name)")
    compare.add_argument("--plot", default=None, help="write one combined figure (PNG) here")
    compare.set_defaults(func=cmd_compare)
    return bench


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: bool) -> None:
    if num_prompts:
        parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    if num_prompts:
        parser.add_argument("--range-ratio", type=float, default=0.0,
                            help="lengths uniform in [len*(1-r), len*(1+r)]")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions, or /v1/chat/completions (whose chat template adds "
                        "tokens to every prompt)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--label", default=None, help="name of this run in `bench compare`")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="random",
                   help=f"{', '.join(BUILTIN_DATASETS)}, or a JSON/JSONL file of prompts "
                        "(prompt, messages or ShareGPT conversations)")
    w.add_argument("--num-requests", type=int, default=64, help="requests (turns) in all")
    w.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (random); question / user-turn tokens (shared-prefix, "
                        "multi-turn)")
    w.add_argument("--output-len", type=int, default=None,
                   help=f"max_tokens of every request (default {DEFAULT_OUTPUT_LEN}; for a file: "
                        "its own lengths)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each system prompt")
    w.add_argument("--num-turns", type=int, default=None,
                   help="multi-turn: turns per conversation (default 4); file: most user turns "
                        "taken from each ShareGPT conversation (default 1)")
    w.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder whose tokenizer builds the prompts "
                        "(default: the bundled model's)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (vLLM extras that fix output lengths)")
    w.add_argument("--extra-body", default=None,
                   help="JSON object merged into every request body")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", default="inf",
                   help="requests (conversations) per second, Poisson arrivals; 'inf' sends all "
                        "at once; a comma list (1,2,4,8) runs a sweep")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    t.add_argument("--max-concurrency", default=None,
                   help="most requests in flight; a comma list (1,4,16) runs a sweep")
    t.add_argument("--seed", type=int, default=0,
                   help="seeds the workload and the arrivals; run i of a sweep uses seed + i")
    t.add_argument("--num-warmups", type=int, default=1, help="untimed requests before measuring")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    r = p.add_argument_group("report")
    r.add_argument("--slo", default=None,
                   help="goodput bounds, e.g. ttft=500ms,tpot=50ms (keys ttft, tpot, itl, e2el)")
    r.add_argument("--output", default=None,
                   help="write config, per-request records and summary (JSON) here")
    r.add_argument("--plot", default=None, help="write latency CDFs (and sweep curves) as PNG")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


# ---- argument checks -----------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rate: {part!r} is not a number; write e.g. 4, inf or "
                             "1,2,4,8") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"--request-rate: {part!r} must be positive (or inf)")
        rates.append(rate)
    return rates


def parse_concurrency(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    values = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ValueError(f"--max-concurrency: {part.strip()!r} is not an integer; write e.g. "
                             "16 or 1,4,16") from None
        if value < 1:
            raise ValueError(f"--max-concurrency: {value} must be >= 1")
        values.append(value)
    return values


def traffic_sweep(args: argparse.Namespace):
    from pagoda.bench.serve import TrafficConfig

    rates = parse_rates(args.request_rate)
    concurrencies = parse_concurrency(args.max_concurrency)
    if len(rates) > 1 and len(concurrencies) > 1:
        raise ValueError("sweep either --request-rate or --max-concurrency, not both")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    return [TrafficConfig(request_rate=r, burstiness=args.burstiness, max_concurrency=c,
                          seed=args.seed)
            for r in rates for c in concurrencies]


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_workload_args(args: argparse.Namespace) -> None:
    _positive("--input-len", args.input_len)
    _positive("--output-len", args.output_len)
    range_ratio = getattr(args, "range_ratio", 0.0)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    for name in ("num_requests", "num_prompts", "num_prefixes", "prefix_len", "num_turns",
                 "num_iters", "timeout"):
        if hasattr(args, name):
            _positive("--" + name.replace("_", "-"), getattr(args, name))


def parse_extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BenchError("--extra-body must be a JSON object")
    return body


# ---- serve -----------------------------------------------------------------------------------------


def load_bench_tokenizer(path: str | None):
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_files(path))


def build_workload(args: argparse.Namespace, tokenizer, seed: int):
    from pagoda.bench import datasets

    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset == "random":
        return datasets.random_dataset(tokenizer, args.num_requests, args.input_len, output_len,
                                       args.range_ratio, seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(tokenizer, args.num_requests, args.num_prefixes,
                                              args.prefix_len, args.input_len, output_len, seed)
    if args.dataset == "multi-turn":
        return datasets.multi_turn_dataset(tokenizer, args.num_requests, args.num_turns or 4,
                                           args.input_len, output_len, seed)
    return datasets.load_file_dataset(args.dataset, args.num_requests, args.output_len,
                                      args.num_turns or 1, seed, tokenizer)


def serve_config(args: argparse.Namespace, base_url: str, model: str | None) -> dict:
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "api_key", "command", "bench_command", "log_level")}
    config.update(base_url=base_url, model=model)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.bench.client import RequestOptions
    from pagoda.bench.metrics import parse_slo
    from pagoda.bench.serve import normalize_base_url, probe_server

    # Every check a user can fail comes before anything slow.
    slo = parse_slo(args.slo) if args.slo is not None else None
    sweep = traffic_sweep(args)
    check_workload_args(args)
    extra_body = parse_extra_body(args.extra_body)
    if args.dataset not in BUILTIN_DATASETS and not os.path.isfile(args.dataset):
        raise ValueError(f"--dataset {args.dataset}: no such file (or use one of "
                         f"{', '.join(BUILTIN_DATASETS)})")
    base_url = normalize_base_url(args.base_url)
    served_model = probe_server(base_url, args.api_key)
    model = args.model or served_model

    try:
        tokenizer = load_bench_tokenizer(args.tokenizer)
    except ValueError:
        if args.dataset in BUILTIN_DATASETS or args.tokenizer:
            raise
        tokenizer = None  # a prompt file needs no tokenizer (only ShareGPT reply lengths do)
    # Each run of a sweep gets its own prompts (seed + run index): repeating the first run's
    # prompts would let later runs hit the server's prefix cache and report a false TTFT.
    workloads = [build_workload(args, tokenizer, args.seed + i) for i in range(len(sweep))]
    options = RequestOptions(endpoint=args.endpoint, model=model, temperature=args.temperature,
                             ignore_eos=args.ignore_eos, extra_body=extra_body,
                             timeout=args.timeout)
    result = asyncio.run(_serve_runs(args, base_url, workloads, options, sweep, slo))
    result["config"].update(serve_config(args, base_url, model))
    if args.output:
        from pagoda.bench.report import write_json

        write_json(args.output, result)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        from pagoda.bench.plots import plot_serve

        plot_serve(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


async def _serve_runs(args, base_url, workloads, options, sweep, slo) -> dict:
    from pagoda.bench import report
    from pagoda.bench.metrics import summarize
    from pagoda.bench.serve import run_traffic, warm_up

    if args.num_warmups > 0:
        await warm_up(base_url, options, args.num_warmups, args.api_key)
    result = report.envelope("serve", args.label or "server", {})
    if args.label:
        result["label"] = args.label
    result["runs"] = []
    for i, (traffic, conversations) in enumerate(zip(sweep, workloads)):
        run = {"request_rate": "inf" if math.isinf(traffic.request_rate) else traffic.request_rate,
               "burstiness": traffic.burstiness, "max_concurrency": traffic.max_concurrency,
               "workload_seed": args.seed + i}
        records, duration = await run_traffic(
            base_url, conversations, options, traffic, api_key=args.api_key,
            description=report.run_label(run), show_progress=args.progress,
        )
        run["summary"] = summarize(records, duration, slo)
        run["requests"] = [r.to_json() for r in records]
        result["runs"].append(run)
        print(report.format_serve_summary(run["summary"], f"{report.run_label(run)}"))
        if run["summary"]["failed"]:
            print(report.format_error_examples(run["requests"]))
    if len(result["runs"]) > 1:
        print(report.format_sweep(result["runs"]))
    return result


# ---- offline -------------------------------------------------------------------------------------


def _offline_llm(args: argparse.Namespace):
    from pagoda.entrypoints.cli import engine_kwargs
    from pagoda.entrypoints.llm import LLM

    return LLM(**engine_kwargs(args))


def cmd_throughput(args: argparse.Namespace) -> int:
    from pagoda.bench import offline, report

    check_workload_args(args)
    llm = _offline_llm(args)
    summary = offline.run_throughput(llm, args.num_prompts, args.input_len, args.output_len,
                                     args.range_ratio, args.seed)
    print(offline.format_throughput(summary, "pagoda"))
    if args.output:
        config = {k: v for k, v in vars(args).items()
                  if k not in ("func", "command", "bench_command", "log_level")}
        config.update(dtype_resolved=str(llm.engine.dtype), device=str(llm.engine.device),
                      model_path=llm.engine.model_files.path)
        result = report.envelope("throughput", "pagoda", config)
        if args.label:
            result["label"] = args.label
        result["summary"] = summary
        report.write_json(args.output, result)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    from pagoda.bench import offline, report

    check_workload_args(args)
    if args.num_warmup_iters < 0:
        raise ValueError(f"--num-warmup-iters must be >= 0, got {args.num_warmup_iters}")
    llm = _offline_llm(args)
    summary, iterations = offline.run_latency(llm, args.input_len, args.output_len,
                                              args.num_iters, args.num_warmup_iters, args.seed)
    print(offline.format_latency(summary, args.input_len, args.output_len))
    if args.output:
        config = {k: v for k, v in vars(args).items()
                  if k not in ("func", "command", "bench_command", "log_level")}
        config.update(dtype_resolved=str(llm.engine.dtype), device=str(llm.engine.device))
        result = report.envelope("latency", "pagoda", config)
        if args.label:
            result["label"] = args.label
        result["summary"] = summary
        result["iterations"] = iterations
        report.write_json(args.output, result)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


# ---- compare -------------------------------------------------------------------------------------


def cmd_compare(args: argparse.Namespace) -> int:
    from pagoda.bench import report

    results = [report.read_json(path) for path in args.results]
    if args.labels is not None:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(results):
            raise ValueError(f"--labels has {len(labels)} names for {len(results)} results")
    else:
        labels = [r.get("label") or os.path.splitext(os.path.basename(p))[0]
                  for r, p in zip(results, args.results)]
    named = list(zip(labels, results))
    print(report.compare_table(named))
    print("\nRatios (×) are to the first column with the same concurrency or rate (else to the "
          "first column); for latencies lower is better.")
    if args.plot:
        from pagoda.bench.plots import plot_compare

        plot_compare(named, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
