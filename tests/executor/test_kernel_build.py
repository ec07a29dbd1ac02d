"""build.build_library's cache: one compile per build however many processes (or threads)
ask for it at once, on a stand-in compiler that counts its runs (no kernel sources: a tiny
library, so the test takes a second)."""

from __future__ import annotations

import ctypes
import stat
import threading
from pathlib import Path

from pagoda.executor.kernels import build

SOURCE = "int pagoda_answer(void) { return 42; }\n"


def counting_compiler(folder: Path) -> tuple[Path, Path]:
    """A `cc` that notes each object it compiles in a log, waits a little (so that callers
    overlap) and hands over to the real compiler; (its path, the log)."""
    log = folder / "compiles.log"
    script = folder / "cc"
    script.write_text("#!/bin/sh\n"
                      f'case "$*" in *" -c "*) echo compiled >> {log}; sleep 0.5;; esac\n'
                      'exec cc "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def test_callers_that_ask_at_once_share_one_compile(tmp_path, monkeypatch) -> None:
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "answer.c").write_text(SOURCE)
    compiler, log = counting_compiler(tmp_path)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path / "cache"))
    built: list[Path] = []
    callers = [threading.Thread(target=lambda: built.append(build.build_library(sources)))
               for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(built) == 3 and len(set(built)) == 1
    assert log.read_text().splitlines() == ["compiled"]  # the others waited, then loaded it
    assert ctypes.CDLL(str(built[0])).pagoda_answer() == 42
    build.build_library(sources, extra_flags=("-O1",))  # another build: compiled again
    assert len(log.read_text().splitlines()) == 2
