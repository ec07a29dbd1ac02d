"""Measuring how closely Pagoda's modes follow a reference run (fidelity.py). Used by the tests
and benchmarks/, never by the server or the engine: nothing at run time imports it."""
