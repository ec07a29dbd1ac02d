"""`pagoda serve` with faults injected by prompt, for the fault tests of
test_server_lifecycle.py: `python -m tests.entrypoints.fault_server serve ...`.

- a prompt containing KILL_MARKER kills the engine loop (a fault in its own bookkeeping)
  once the request is added;
- a prompt ending in POISON_MARKER makes the detokenizer raise at that request's third
  token (a fault of that request alone).
"""

from __future__ import annotations

import sys

from pagoda.cli.main import main
from pagoda.engine.core.detokenizer import IncrementalDetokenizer
from pagoda.engine.loop.engine_loop import EngineLoop

KILL_MARKER = "KILL THE ENGINE LOOP"
POISON_MARKER = "POISON"


def _add_then_maybe_break(self: EngineLoop, request) -> None:
    _add(self, request)
    if KILL_MARKER in (request.prompt or ""):
        def broken() -> bool:
            raise RuntimeError("injected fault in the engine loop's bookkeeping")

        self.engine.has_unfinished_requests = broken


def _init_marking_poisoned(self: IncrementalDetokenizer, tokenizer, prompt_token_ids, *args):
    _init(self, tokenizer, prompt_token_ids, *args)
    poisoned = tokenizer.decode(list(prompt_token_ids[-4:])).rstrip().endswith(POISON_MARKER)
    self.poison_countdown = 3 if poisoned else None


def _update_maybe_failing(self: IncrementalDetokenizer, new_token_ids):
    if self.poison_countdown is not None:
        self.poison_countdown -= 1
        if self.poison_countdown == 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
    return _update(self, new_token_ids)


_add = EngineLoop._add
EngineLoop._add = _add_then_maybe_break
_init, _update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update
IncrementalDetokenizer.__init__ = _init_marking_poisoned
IncrementalDetokenizer.update = _update_maybe_failing

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
