"""Tool calling, independent of HTTP: what a request's tools mean (plan.py), how they and the
calls of a conversation reach the prompt (rendering.py: the model's template, or the Hermes
fallback format), the grammar that forces valid calls (constraints.py), and reading calls
back out of the model's text, whole or streamed, in each family's format (parsers/: hermes,
llama3_json, pythonic, mistral, qwen3_coder, the forced-call layout, and `auto`).

The format, where the model's template has none of its own (Hermes, as Qwen2.5 uses it):

    system:     # Tools ... <tools>\\n{"type": "function", "function": {...}}\\n</tools> ...
    assistant:  <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    user:       <tool_response>\\n{"temperature": 21}\\n</tool_response>

The server's glue is pagoda/entrypoints/openai/serving/tools.py.
"""
