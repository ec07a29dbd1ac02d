"""pagoda/entrypoints/ is the product's API only: nothing in it imports the benchmarks
(pagoda/bench/) or the A/B tools (pagoda/ab/). What the server and A/B share, the traffic
record, is pagoda/traffic_record.py, which imports no other pagoda module."""

from __future__ import annotations

from tests.engine.test_layering import PACKAGE, imported_modules

TOOLS = ("pagoda.bench", "pagoda.ab")


def is_tool(name: str) -> bool:
    return any(name == tool or name.startswith(tool + ".") for tool in TOOLS)


def offenders(folder: str, forbidden) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}: {name}"
            for path in sorted((PACKAGE / folder).rglob("*.py"))
            for name in imported_modules(path) if forbidden(name)]


def test_nothing_in_entrypoints_imports_bench_or_ab():
    assert offenders("entrypoints", is_tool) == []
    # (the check itself works: A/B imports the benchmarks' client)
    assert offenders("ab", is_tool)
    assert not is_tool("pagoda.abc") and is_tool("pagoda.ab") and is_tool("pagoda.bench.serve")


def test_the_benchmarks_do_not_import_ab():
    assert offenders("bench", lambda name: is_tool(name) and name.startswith("pagoda.ab")) == []


def test_the_traffic_record_imports_no_pagoda_module():
    names = imported_modules(PACKAGE / "traffic_record.py")
    assert [name for name in names if name.split(".")[0] == "pagoda"] == []
    # the server's recorder and A/B both read and write it
    assert "pagoda.traffic_record" in imported_modules(
        PACKAGE / "entrypoints" / "openai" / "traffic_recorder.py")
    assert "pagoda.traffic_record" in imported_modules(PACKAGE / "ab" / "replay.py")
