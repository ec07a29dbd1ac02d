"""The handlers that serve a parsed request on a model's engine (above protocol/, below the
routes): the one pipeline of completions and chat (pipeline.py) with each endpoint's part
(completion.py, chat.py, and chat's tools.py and reasoning.py), embeddings, the engine
streams as HTTP responses (streaming.py), vLLM's extras, and the request guards."""
