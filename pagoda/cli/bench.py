"""`pagoda bench serve | soak | ab | throughput | latency | compare`: the CLI of pagoda/bench/.

`bench serve` lives in bench_serve.py, `bench soak` in bench_soak.py, `bench ab` in
bench_ab.py; the offline benchmarks (throughput, latency) and `compare` here. Values a
user can get wrong raise ValueError (checks in bench_args.py), which `pagoda.cli.main`
prints as one line before exiting with 2. Everything slow (tokenizer, model, traffic)
starts only after all arguments are checked.
"""

from __future__ import annotations

import argparse
import os
import sys

from pagoda.cli import bench_ab, bench_serve, bench_soak
from pagoda.cli.bench_args import DefaultsHelpFormatter, check_workload_args
from pagoda.cli.shared_args import add_engine_args, engine_kwargs


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serving, offline throughput, latency")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve.register(sub)
    bench_soak.register(sub)
    bench_ab.register(sub)

    throughput = sub.add_parser("throughput", help="offline engine throughput on a fixed workload",
                                formatter_class=DefaultsHelpFormatter)
    add_workload_args(throughput, num_prompts=True)
    throughput.add_argument("--output", default=None, help="write the result JSON here")
    throughput.add_argument("--label", default=None, help="name of this run in `bench compare`")
    add_engine_args(throughput)
    throughput.set_defaults(func=run_throughput)

    latency = sub.add_parser("latency", help="single-request prefill time and decode speed",
                             formatter_class=DefaultsHelpFormatter)
    add_workload_args(latency, num_prompts=False)
    latency.add_argument("--num-iters", type=int, default=5, help="measured requests")
    latency.add_argument("--num-warmup-iters", type=int, default=1, help="untimed requests first")
    latency.add_argument("--output", default=None, help="write the result JSON here")
    latency.add_argument("--label", default=None, help="name of this run in `bench compare`")
    add_engine_args(latency)
    latency.set_defaults(func=run_latency)

    compare = sub.add_parser("compare", help="one markdown table (and figure) of several results")
    compare.add_argument("results", nargs="+",
                         help="result JSON files; ratios are to the first file (run by run for "
                              "sweeps)")
    compare.add_argument("--labels", default=None,
                         help="comma-separated column names (default: each file's label or name)")
    compare.add_argument("--plot", default=None, help="write one combined figure (PNG) here")
    compare.set_defaults(func=run_compare)


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: bool) -> None:
    if num_prompts:
        parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    if num_prompts:
        parser.add_argument("--range-ratio", type=float, default=0.0,
                            help="lengths uniform in [len*(1-r), len*(1+r)]")


# ---- offline -------------------------------------------------------------------------------------


def _offline_llm(args: argparse.Namespace):
    from pagoda.entrypoints.llm import LLM

    return LLM(**engine_kwargs(args))


def run_throughput(args: argparse.Namespace) -> int:
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


def run_latency(args: argparse.Namespace) -> int:
    from pagoda.bench import offline, report

    check_workload_args(args)
    if args.num_warmup_iters < 0:
        raise ValueError(f"--num-warmup-iters must be >= 0, got {args.num_warmup_iters}")
    llm = _offline_llm(args)
    summary, iterations = offline.run_latency(llm, args.input_len, args.output_len,
                                              args.num_iters, args.num_warmup_iters, args.seed)
    summary["weight_traffic"] = offline.weight_traffic(llm, summary["decode_tokens_per_s"]["median"])
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


def run_compare(args: argparse.Namespace) -> int:
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
