"""Reasoning models, independent of HTTP: splitting the thinking (`<think>...</think>`) off the
answer, whole or streamed (parsers.py), and picking the parser a chat template's model needs
(auto.py). Structured outputs leave the thinking free through
`StructuredOutputsParams.after_reasoning` (pagoda/structured_outputs.py,
pagoda/engine/core/grammar.py).

The server's glue is pagoda/entrypoints/openai/serving/reasoning.py: the reasoning is split
off first, then the rest is the content, read for tool calls where the request offers tools.
"""

from pagoda.entrypoints.reasoning.auto import (
    REASONING_PARSER_CHOICES,
    resolve_reasoning_parser,
)
from pagoda.entrypoints.reasoning.parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    split_reasoning,
)
from pagoda.entrypoints.reasoning.registry import REASONING_PARSERS

__all__ = ["REASONING_PARSERS", "REASONING_PARSER_CHOICES", "ReasoningDelta",
           "ReasoningParser", "ReasoningSplit", "resolve_reasoning_parser", "split_reasoning"]
