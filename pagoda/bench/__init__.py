"""Benchmarks: `pagoda bench serve | throughput | latency | compare`; their command line is in
pagoda/cli/bench.py and pagoda/cli/bench_serve.py."""


class BenchError(ValueError):
    """A user's mistake in a benchmark's arguments or inputs: the CLI prints it as one line
    and exits with code 2."""
