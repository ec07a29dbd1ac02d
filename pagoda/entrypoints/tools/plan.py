"""What a request's `tools`, `tool_choice` and `parallel_tool_calls` mean for its prompt and
its output, decided once and checked at the edge (each refusal a 400 naming its field).

    tool_choice          prompt lists tools   output                     read by
    "none"               no                   free text                  (nothing)
    "auto" (default)     yes                  free text                  --tool-call-parser
    "required"           yes                  >= 1 call, any function    forced-call parser
    {"function": {name}} yes                  1 call to that one         forced-call parser

A named function is called exactly once, as OpenAI does. With `parallel_tool_calls: false`
at most one call is made ("required": exactly one, by the grammar; "auto": calls after the
first are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.tools.constraints import tool_call_grammar
from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    mode: str
    """"none", "auto", "required" or "named"."""
    tools: tuple[dict[str, Any], ...] = ()
    """The request's tools as OpenAI dicts ({"type": "function", "function": {...}})."""
    call_names: tuple[str, ...] = ()
    """The functions the output may call."""
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
           parallel_tool_calls: bool | None) -> ToolPlan:
        """The plan of a request; InvalidRequestError for tool_choice without tools, a
        named function that is not among them, or two functions with one name."""
        tools = list(tools or [])
        names = [tool["function"]["name"] for tool in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise InvalidRequestError.about(
                    "tools", f"has two functions named {name!r}; names must be unique")
        parallel = parallel_tool_calls is not False
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if not tools:
            if tool_choice != "none":
                raise InvalidRequestError.about(
                    "tool_choice", "needs `tools`: give the functions the model may call")
            return cls("none", parallel=parallel)
        if isinstance(tool_choice, str):
            mode, call_names = tool_choice, tuple(names)
        else:
            name = tool_choice["function"]["name"]
            if name not in names:
                raise InvalidRequestError.about(
                    "tool_choice", f"names the function {name!r}, which is not in `tools` "
                                   f"(functions: {', '.join(names)})")
            mode, call_names = "named", (name,)
        if mode == "none":
            call_names = ()
        return cls(mode, tuple(tools), call_names, parallel)

    @property
    def offers_tools(self) -> bool:
        """Whether the prompt lists the tools and the output is read for calls ("none":
        the model is not offered them)."""
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether the output is forced to be calls (grammar from constraints.py)."""
        return self.mode in ("required", "named")

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def functions(self, names: tuple[str, ...]) -> list[dict[str, Any]]:
        """The function definitions of `names`, in tool order."""
        return [t["function"] for t in self.tools if t["function"]["name"] in names]

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that makes the output calls, when the plan asks for calls."""
        if not self.constrained:
            return None
        parallel = self.parallel and self.mode == "required"
        grammar = tool_call_grammar(self.functions(self.call_names), parallel)
        return StructuredOutputsParams(grammar=grammar)
