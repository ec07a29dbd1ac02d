"""`pagoda bench serve`: load an OpenAI-compatible server with a workload and measure it.

Every check a user can fail (pagoda/cli/bench_args.py) comes before the tokenizer, the
workload or the traffic start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys

from pagoda.bench.datasets import (
    BUILTIN_DATASETS,
    DEFAULT_GROUNDED_PASSAGE_LEN,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
)
from pagoda.cli.bench_args import (
    DefaultsHelpFormatter,
    check_workload_args,
    parse_extra_body,
    traffic_sweep,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_REQUESTS = 64
DEFAULT_NUM_TURNS = 4
"""--num-turns of the multi-turn workload when not given."""


def register(bench_subparsers) -> None:
    """Add `serve` under `pagoda bench`."""
    serve = bench_subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server and measure it",
        formatter_class=DefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_bench_serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--lora-names", default=None, metavar="A,B,C",
                   help="spread the requests over these served names (LoRA adapters, or "
                        "models) as their `model`, round-robin by conversation from a seeded "
                        "start; the report counts the requests of each")
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
    w.add_argument("--num-requests", type=int, default=None,
                   help=f"requests (turns) in all (default: {DEFAULT_NUM_REQUESTS}; multi-turn "
                        "with --num-users: users x turns)")
    w.add_argument("--input-len", type=int, default=None,
                   help=f"prompt tokens (random); question / user-turn tokens (shared-prefix, "
                        f"multi-turn); default {DEFAULT_INPUT_LEN}. grounded: tokens of the "
                        f"passage to copy from, default {DEFAULT_GROUNDED_PASSAGE_LEN}")
    w.add_argument("--output-len", type=int, default=None,
                   help=f"max_tokens of every request (default {DEFAULT_OUTPUT_LEN}; for a file: "
                        "its own lengths)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random, grounded: lengths uniform in [len*(1-r), len*(1+r)]")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each system prompt")
    w.add_argument("--num-turns", type=int, default=None,
                   help="multi-turn: turns per conversation (default 4); file: most user turns "
                        "taken from each ShareGPT conversation (default 1)")
    w.add_argument("--num-users", type=int, default=None,
                   help="multi-turn: conversations, each of --num-turns turns sent one after "
                        "the other while the users run side by side (default: --num-requests "
                        "/ --num-turns)")
    w.add_argument("--system-prompt-len", type=int, default=None,
                   help="multi-turn: tokens of a system prompt every user's conversation "
                        "starts with (default: 0, none)")
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
    r.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                   help="what an hour of the servers under test costs: the summary adds the "
                        "run's cost and cost per million input and output tokens (default: "
                        "the server's own pagoda:cost_per_hour from `pagoda serve "
                        "--cost-per-hour`, if it reports one)")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def load_bench_tokenizer(path: str | None):
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_files(path))


def default_input_len(dataset: str) -> int:
    """--input-len when not given: the grounded passage is longer than the other prompts."""
    return DEFAULT_GROUNDED_PASSAGE_LEN if dataset == "grounded" else DEFAULT_INPUT_LEN


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
        return datasets.multi_turn_dataset(tokenizer, args.num_requests, args.num_turns,
                                           args.input_len, output_len, seed,
                                           args.system_prompt_len or 0)
    if args.dataset == "grounded":
        return datasets.grounded_dataset(tokenizer, args.num_requests, args.input_len,
                                         output_len, args.range_ratio, seed)
    return datasets.load_file_dataset(args.dataset, args.num_requests, args.output_len,
                                      args.num_turns or 1, seed, tokenizer)


def resolve_conversation_args(args: argparse.Namespace) -> None:
    """Check the multi-turn flags and fill in the defaults they imply (recorded in the
    result's config): --num-users U with --num-turns T sends U x T requests. ValueError
    naming the flag for a bad combination."""
    multi_turn = args.dataset == "multi-turn"
    for flag, value in (("--num-users", args.num_users),
                        ("--system-prompt-len", args.system_prompt_len)):
        if value is not None and not multi_turn:
            raise ValueError(f"{flag} applies to --dataset multi-turn only (got --dataset "
                             f"{args.dataset})")
    if args.num_users is not None and args.num_users < 1:
        raise ValueError(f"--num-users must be >= 1, got {args.num_users}")
    if args.system_prompt_len is not None and args.system_prompt_len < 0:
        raise ValueError(f"--system-prompt-len must be >= 0, got {args.system_prompt_len}")
    if multi_turn and args.num_turns is None:
        args.num_turns = DEFAULT_NUM_TURNS
    if args.num_users is not None:
        total = args.num_users * args.num_turns
        if args.num_requests is not None and args.num_requests != total:
            raise ValueError(f"--num-requests {args.num_requests} disagrees with --num-users "
                             f"{args.num_users} x --num-turns {args.num_turns} = {total}; "
                             "give one or the other")
        args.num_requests = total
    if args.num_requests is None:
        args.num_requests = DEFAULT_NUM_REQUESTS


def serve_config(args: argparse.Namespace, base_url: str, model: str | None) -> dict:
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "api_key", "command", "bench_command", "log_level")}
    config.update(base_url=base_url, model=model)
    return config


def parse_lora_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError(f"--lora-names {text!r}: give comma-separated names, none empty")
    return names


def run_bench_serve(args: argparse.Namespace) -> int:
    from pagoda.bench.client import RequestOptions
    from pagoda.bench.metrics import parse_slo
    from pagoda.bench.serve import normalize_base_url, probe_server

    # Every check a user can fail comes before anything slow.
    slo = parse_slo(args.slo) if args.slo is not None else None
    if args.cost_per_hour is not None:
        from pagoda.cost import check_cost_per_hour

        check_cost_per_hour(args.cost_per_hour)
    sweep = traffic_sweep(args)
    check_workload_args(args)
    resolve_conversation_args(args)
    if args.input_len is None:
        args.input_len = default_input_len(args.dataset)  # recorded in the result's config
    extra_body = parse_extra_body(args.extra_body)
    if args.dataset not in BUILTIN_DATASETS and not os.path.isfile(args.dataset):
        raise ValueError(f"--dataset {args.dataset}: no such file (or use one of "
                         f"{', '.join(BUILTIN_DATASETS)})")
    lora_names = parse_lora_names(args.lora_names)
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
    result = asyncio.run(_serve_runs(args, base_url, workloads, options, sweep, slo,
                                     lora_names))
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


async def _serve_runs(args, base_url, workloads, options, sweep, slo, lora_names=None) -> dict:
    from pagoda.bench import report
    from pagoda.bench.serve import spread_models, warm_up
    from pagoda.bench.server_cost import run_cost, scrape_cost_per_hour

    if args.num_warmups > 0:
        for model in lora_names or [options.model]:  # (each adapter loads on first use)
            await warm_up(base_url, dataclasses.replace(options, model=model),
                          args.num_warmups, args.api_key)
    cost_per_hour, cost_source = args.cost_per_hour, "flag"
    result = report.envelope("serve", args.label or "server", {})
    if args.label:
        result["label"] = args.label
    result["runs"] = []
    for i, (traffic, conversations) in enumerate(zip(sweep, workloads)):
        run = {"request_rate": "inf" if math.isinf(traffic.request_rate) else traffic.request_rate,
               "burstiness": traffic.burstiness, "max_concurrency": traffic.max_concurrency,
               "workload_seed": args.seed + i}
        run["summary"], run["requests"] = await _measured_run(
            args, base_url, conversations, options, traffic, slo, report.run_label(run),
            lora_names and spread_models(len(conversations), lora_names, args.seed + i))
        if cost_source == "flag" and cost_per_hour is None:
            # the server's own price, read once (after the first run's scrapes)
            cost_per_hour = await scrape_cost_per_hour(base_url, args.api_key)
            cost_source = "server"
        if cost_per_hour is not None:
            run["summary"]["cost"] = run_cost(run["summary"], cost_per_hour, cost_source)
        result["runs"].append(run)
        print(report.format_serve_summary(run["summary"], f"{report.run_label(run)}"))
        if run["summary"]["failed"]:
            print(report.format_error_examples(run["requests"]))
    if len(result["runs"]) > 1:
        print(report.format_sweep(result["runs"]))
    return result


async def _measured_run(args, base_url, conversations, options, traffic, slo, description,
                        models=None):
    """One run's summary and request records. The server's /metrics is read before and after
    the traffic; the summary gets "spec_decode" when drafts were made in between."""
    from pagoda.bench.metrics import summarize
    from pagoda.bench.serve import run_traffic
    from pagoda.bench.server_metrics import scrape_spec_decode_counters, spec_decode_figures

    before = await scrape_spec_decode_counters(base_url, args.api_key)
    records, duration = await run_traffic(
        base_url, conversations, options, traffic, api_key=args.api_key,
        description=description, show_progress=args.progress, models=models,
    )
    after = await scrape_spec_decode_counters(base_url, args.api_key)
    summary = summarize(records, duration, slo)
    spec_decode = spec_decode_figures(before, after)
    if spec_decode is not None:
        summary["spec_decode"] = spec_decode
    return summary, [r.to_json() for r in records]
