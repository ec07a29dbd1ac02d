"""--reasoning-parser NAME -> its parser class ("auto" is resolved to one of these: auto.py)."""

from __future__ import annotations

from pagoda.entrypoints.reasoning.harmony import HarmonyReasoningParser
from pagoda.entrypoints.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)
}
