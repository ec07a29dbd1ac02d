"""The `pagoda` command.

main.py builds the parser from one module per subcommand (generate, chat, serve, bench, env),
each exposing `register(subparsers)`; shared_args.py holds the options several of them take
(the engine's, generated from pagoda/config.py, and sampling). Imports only run downwards:
main -> subcommand modules -> shared_args -> pagoda.config; no subcommand imports main.py.
Every command keeps its heavy imports (torch, the engine, the server) inside the function that
runs it, so `pagoda --help` stays fast.
"""
