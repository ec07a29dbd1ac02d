"""Every script in benchmarks/ still runs against today's code, so that rot fails here rather
than in the next person's benchmark session: each Python script imports and answers `--help`
(in this process: cheap, and a script must do no work before parsing its arguments), each
shell script parses (`bash -n`), calls only scripts that exist, and calls `pagoda` with
subcommands and flags its parser still has. BENCHMARKS.md cites only files that exist, and
benchmarks/results/ holds summaries only: no code, under about 1 MB."""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
PY_SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SH_SCRIPTS = sorted(BENCHMARKS.glob("*.sh"))
RESULTS_BYTE_LIMIT = 1_000_000


def test_the_scripts_are_found() -> None:
    assert len(PY_SCRIPTS) >= 15 and len(SH_SCRIPTS) >= 10


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=lambda p: p.name)
def test_each_python_script_imports(path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as `python benchmarks/X.py` runs it
    spec = importlib.util.spec_from_file_location(f"benchmark_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


COMMAND_LINE_SCRIPTS = [p for p in PY_SCRIPTS if '__name__ == "__main__"' in p.read_text()]


@pytest.mark.parametrize("path", COMMAND_LINE_SCRIPTS, ids=lambda p: p.name)
def test_each_command_line_script_answers_help(path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", SH_SCRIPTS, ids=lambda p: p.name)
def test_each_shell_script_parses(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def shell_lines(path: Path) -> list[str]:
    """The script's lines with continuations joined and comments dropped."""
    text = path.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if not line.lstrip().startswith("#")]


@pytest.mark.parametrize("path", SH_SCRIPTS, ids=lambda p: p.name)
def test_each_shell_script_calls_scripts_that_exist(path: Path) -> None:
    named = set()
    for line in shell_lines(path):
        named |= set(re.findall(r"benchmarks/([\w-]+\.(?:py|sh))", line))
        named |= set(re.findall(r"\$\(dirname \"\$0\"\)/([\w-]+\.(?:py|sh))", line))
    missing = sorted(name for name in named if not (BENCHMARKS / name).exists())
    assert not missing, missing


def subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


PAGODA_COMMAND = re.compile(r"(?:\$PAGODA|\bpagoda)\s+((?:bench\s+)?[a-z][a-z-]*)\b(.*)")


@pytest.mark.parametrize("path", SH_SCRIPTS, ids=lambda p: p.name)
def test_each_shell_script_calls_pagoda_as_it_is(path: Path) -> None:
    """`pagoda serve ...` / `pagoda bench X ...`: the subcommand exists, and every literal
    --flag up to the end of that command (a pipe, `;`, `&`, a redirection) is one of its
    options. Flags passed through variables are not seen."""
    from pagoda.cli.main import build_parser

    root = build_parser()
    problems = []
    for line in shell_lines(path):
        for match in PAGODA_COMMAND.finditer(line):
            parser = root
            for word in match.group(1).split():
                parser = subcommands(parser).get(word)
                if parser is None:
                    problems.append(f"no subcommand {match.group(1)!r}: {line.strip()}")
                    break
            if parser is None:
                continue
            known = {flag for action in parser._actions for flag in action.option_strings}
            command = re.split(r"[|;&>]|\$\(|\)", match.group(2))[0]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command):
                if flag not in known:
                    problems.append(f"{match.group(1)} has no {flag}: {line.strip()}")
    assert not problems, problems


def test_benchmarks_md_cites_only_what_exists() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    missing = []
    for cited in re.findall(r"`(?:benchmarks/)?(?:results/)?(20\d\d-\d\d-\d\d-[^`/]+/?[^`]*)`",
                            text):
        if "{" in cited:  # `2026-12-03-session3-{compiled,eager}/`
            head, rest = cited.split("{", 1)
            options, tail = rest.split("}", 1)
            paths = [head + option + tail for option in options.split(",")]
        else:
            paths = [cited]
        missing += [p for p in paths if not list(RESULTS.glob(p.rstrip("/")))]
    for script in re.findall(r"`(?:\S+ )?(benchmarks/[\w-]+\.(?:py|sh|c))", text):
        if not (ROOT / script).exists():
            missing.append(script)
    assert not missing, missing


def test_results_hold_summaries_only() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    code = [str(p.relative_to(RESULTS)) for p in files
            if p.suffix in (".py", ".sh", ".c", ".h", ".ipynb")]
    assert not code, f"code belongs in benchmarks/, not results/: {code}"
    total = sum(p.stat().st_size for p in files)
    assert total < RESULTS_BYTE_LIMIT, f"benchmarks/results/ holds {total} bytes"


def test_the_amx_instruction_timer_compiles() -> None:
    """benchmarks/amx_instructions.c (run only on an AMX CPU) still compiles."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed (the kernels build with it too)"
    result = subprocess.run([compiler, "-fsyntax-only", "-march=sapphirerapids",
                             str(BENCHMARKS / "amx_instructions.c")], check=False,
                            capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
