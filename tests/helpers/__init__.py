"""Helpers shared by the test packages: one free loopback port (ports.py) and one fake
OpenAI-compatible server, in a thread or a process of its own (fake_server.py). The real
`pagoda serve` process the server tests start is tests/entrypoints/server_helpers.py's
RemoteServer (its session-wide shared instance: tests/conftest.py's `shared_server`)."""
