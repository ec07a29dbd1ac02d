"""Tool-call parsers: a model's output text -> content + tool calls, streamed or whole.

One parser per output format, chosen with `pagoda serve --tool-call-parser NAME` (as in vLLM;
`auto` picks one from the chat template: auto.py) and used with `tool_choice: "auto"`:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>    Hermes 2 Pro, Qwen2.5
    llama3_json  <|python_tag|>{"name": "f", "parameters": {...}}; {...}      Llama 3.1 / 3.2
    pythonic     [f(city="Paris", days=3), g()]                               Llama 3.2 / 4
    mistral      [TOOL_CALLS] [{"name": "f", "arguments": {...}}]             Mistral v3
                 [TOOL_CALLS]f[ARGS]{...}                                     Mistral v11+
    qwen3_coder  <tool_call><function=f><parameter=city>Paris</parameter>...  Qwen3-Coder
    openai       <|start|>assistant<|channel|>commentary to=functions.f       gpt-oss
                 <|constrain|>json<|message|>{...}<|call|>                    (harmony)

A constrained call (tool_choice "required" or a named function) is always written in the
layout of tools/constraints.py's grammar and read by forced.py, whatever the server's parser.

Every parser is a state machine fed the output's text deltas, built on base.py: a streamed
answer assembles to exactly the whole one however the text is cut, no text is sent and then
retracted, a call counts only when it names one of the request's functions (anything else
stays content, as written), and `max_calls` (1 when the request sets parallel_tool_calls
false) drops the calls past it.
"""

from pagoda.entrypoints.tools.parsers.auto import resolve_tool_call_parser
from pagoda.entrypoints.tools.parsers.base import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallFragment,
    ToolParser,
    assemble,
    parse_output,
)
from pagoda.entrypoints.tools.parsers.forced import ForcedCallParser
from pagoda.entrypoints.tools.parsers.hermes import HermesToolParser
from pagoda.entrypoints.tools.parsers.llama3_json import Llama3JsonToolParser
from pagoda.entrypoints.tools.parsers.mistral import MistralToolParser
from pagoda.entrypoints.tools.parsers.openai import OpenAIToolParser
from pagoda.entrypoints.tools.parsers.pythonic import PythonicToolParser
from pagoda.entrypoints.tools.parsers.qwen3_coder import Qwen3CoderToolParser
from pagoda.entrypoints.tools.parsers.registry import AUTO, TOOL_PARSER_CHOICES, TOOL_PARSERS

__all__ = [
    "AUTO", "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "ForcedCallParser", "HermesToolParser",
    "Llama3JsonToolParser", "MistralToolParser", "OpenAIToolParser", "ParsedOutput",
    "PythonicToolParser",
    "Qwen3CoderToolParser", "StreamDelta", "ToolCall", "ToolCallFragment", "ToolParser",
    "assemble", "parse_output", "resolve_tool_call_parser",
]
