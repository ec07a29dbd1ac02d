"""The OpenAI protocol as Pagoda serves it, the lowest level of the server: the pydantic
requests (requests.py, embedding.py, and the field groups they mix in: chat_template_fields,
structured_fields, tool_fields), the response bodies (responses.py), the field policy, the
JSON shapes /openapi.json gives, and OpenAI-style errors. Nothing here imports serving/ or
the engine."""
