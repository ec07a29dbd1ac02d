"""`pagoda serve` whose engine loop dies (a fault in its own bookkeeping) once a request
whose prompt contains KILL_MARKER is added: `python -m tests.entrypoints.dying_server serve
...`, for the engine-death test of test_server_lifecycle.py."""

from __future__ import annotations

import sys

from pagoda.cli.main import main
from pagoda.engine.async_engine import AsyncLLMEngine

KILL_MARKER = "KILL THE ENGINE LOOP"


def _add_then_maybe_break(self: AsyncLLMEngine, command) -> None:
    _add(self, command)
    if KILL_MARKER in (command.request.prompt or ""):
        def broken() -> bool:
            raise RuntimeError("injected fault in the engine loop's bookkeeping")

        self.engine.has_unfinished_requests = broken


_add = AsyncLLMEngine._add
AsyncLLMEngine._add = _add_then_maybe_break

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
