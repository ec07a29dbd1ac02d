"""Benchmarks: `pagoda bench serve | throughput | latency | compare` (see cli.py)."""


class BenchError(ValueError):
    """A user's mistake in a benchmark's arguments or inputs: the CLI prints it as one line
    and exits with code 2."""
