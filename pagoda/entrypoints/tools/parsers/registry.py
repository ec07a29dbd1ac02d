"""--tool-call-parser NAME -> its parser class (the formats are listed in __init__.py)."""

from __future__ import annotations

from pagoda.entrypoints.tools.parsers.base import ToolParser
from pagoda.entrypoints.tools.parsers.hermes import HermesToolParser
from pagoda.entrypoints.tools.parsers.llama3_json import Llama3JsonToolParser
from pagoda.entrypoints.tools.parsers.mistral import MistralToolParser
from pagoda.entrypoints.tools.parsers.openai import OpenAIToolParser
from pagoda.entrypoints.tools.parsers.pythonic import PythonicToolParser
from pagoda.entrypoints.tools.parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser,
                                       PythonicToolParser, MistralToolParser,
                                       Qwen3CoderToolParser, OpenAIToolParser)
}
AUTO = "auto"
"""Pick the parser from the chat template (auto.py)."""
TOOL_PARSER_CHOICES = (*TOOL_PARSERS, AUTO)
"""The values of --tool-call-parser."""
