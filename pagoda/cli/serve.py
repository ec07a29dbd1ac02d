"""`pagoda serve`: the OpenAI-compatible server on uvicorn.

Lifecycle: check the flags and build the EngineConfig (a bad value fails before anything slow),
load the model on the engine thread (slow), log the URL, the model and the KV capacity, serve.
On SIGTERM or SIGINT: refuse new /v1 requests (503; uvicorn also stops accepting connections),
let in-flight ones finish for up to --shutdown-timeout seconds, cancel (abort) the rest,
stop the engine thread, exit 0. A second SIGINT quits at once. If the engine loop dies: open
streams end with an error event, /health says 503, and two seconds later the server shuts
down and exits 1 (for a supervisor to restart it).
"""

from __future__ import annotations

import argparse
import logging
import os

from pagoda.cli.shared_args import add_engine_args, engine_config
from pagoda.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES
from pagoda.entrypoints.tools.parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGODA_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", default=None,
                        help="model name in the API (default: the model file or folder name)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (or set {API_KEY_ENV})")
    server.add_argument("--max-queue", type=int, default=None,
                        help="most sequences waiting for a batch slot; more get 503 + "
                             "Retry-After (default: no limit)")
    server.add_argument("--chat-template", default=None,
                        help="Jinja chat template file (default: the model's own)")
    server.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                        help="how tool calls are read from the model's text with tool_choice "
                             "'auto' (default: hermes, <tool_call>{json}</tool_call>)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    server.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log every HTTP request")
    server.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413 (default: 16 MiB)")
    server.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run before it is stopped with 408 (a "
                             "stream ends with an error event); default: no limit")
    server.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="browser origins allowed to call the API (CORS), e.g. "
                             "https://app.example.com, or '*' for any (default: none)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    server.add_argument("--ssl-certfile", default=None,
                        help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    add_engine_args(parser)
    parser.set_defaults(func=run_serve)


def check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_request_bytes <= 0:
        raise ValueError(f"--max-request-bytes must be > 0, got {args.max_request_bytes}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e.strerror})") from None


def run_serve(args: argparse.Namespace) -> int:
    from prometheus_client import ProcessCollector

    import pagoda
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.engine.builder import build_engine
    from pagoda.engine.metrics import EngineMetrics
    from pagoda.entrypoints.openai.server import ServerState, build_app, run_server

    check_server_args(args)
    config = engine_config(args)
    chat_template = read_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    pagoda_logger = logging.getLogger("pagoda")
    if pagoda_logger.getEffectiveLevel() > logging.INFO:
        pagoda_logger.setLevel(logging.INFO)  # a server reports its start-up and shutdown

    async_engine = AsyncLLMEngine.build_on_engine_thread(
        lambda: build_engine(config), max_queue=args.max_queue,
    )
    engine = async_engine.engine
    model_name = args.served_model_name or engine.model_files.name
    metrics = EngineMetrics(model_name)
    # process_resident_memory_bytes, CPU seconds, open fds (as vLLM): what a soak watches
    ProcessCollector(registry=metrics.registry)
    async_engine.metrics = metrics  # used by the loop from start() on
    state = ServerState(
        engine=async_engine, metrics=metrics, model_name=model_name,
        model_root=engine.model_files.path, api_key=api_key, chat_template=chat_template,
        tool_call_parser=args.tool_call_parser, max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout, allowed_origins=tuple(args.allowed_origins),
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if args.ssl_certfile else "http"
    logger.info(
        "Pagoda %s serving model %r on %s://%s:%d (KV cache capacity %d tokens, max_model_len "
        "%d, API key %s)", pagoda.__version__, model_name, scheme, host, args.port,
        engine.kv_capacity_tokens, engine.max_model_len, "required" if api_key else "not required",
    )
    exit_code = run_server(build_app(state), state, args.host, args.port,
                           args.shutdown_timeout, access_log=args.access_log,
                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    logger.info("Pagoda server stopped")
    return exit_code
