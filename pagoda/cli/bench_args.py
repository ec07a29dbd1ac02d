"""Checks of the `pagoda bench` flags, run before anything slow (tokenizer, model, traffic):
each raises ValueError (BenchError included) with a message naming the flag, which
`pagoda.cli.main` prints as one line before exiting with 2."""

from __future__ import annotations

import argparse
import json
import math

from pagoda.bench import BenchError


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to a flag's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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
