"""`pagoda serve`'s own flags (the server's and its LoRA adapters'; the engine's come from
pagoda/config.py, Ray Serve's from pagoda/deploy/options.py) and their checks, which run
before anything slow. cli/serve.py and deploy/app.py parse with them; api_server.py builds
the server they describe.
"""

from __future__ import annotations

import argparse
import os

from pagoda.entrypoints.openai.lora_args import add_lora_args
from pagoda.entrypoints.openai.model_registry import DEFAULT_MODEL_LOAD_TIMEOUT_S
from pagoda.entrypoints.openai.responses_api.store import DEFAULT_STORE_SIZE, DEFAULT_STORE_TTL_S
from pagoda.entrypoints.openai.serving.guards import DEFAULT_MAX_REQUEST_BYTES
from pagoda.entrypoints.reasoning.auto import REASONING_PARSER_CHOICES
from pagoda.entrypoints.tools.parsers import TOOL_PARSER_CHOICES

API_KEY_ENV = "PAGODA_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The "server" group: --host, --port, --api-key, ..., the LoRA flags."""
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", action="append", default=None,
                        help="model name in the API (default: the model file or folder name); "
                             "with several --model, one each, in the same order")
    server.add_argument("--max-loaded-models", type=int, default=None,
                        help="most models loaded at once: loading one more (POST "
                             "/v1/models/load) first unloads the least recently used "
                             "(default: no limit)")
    server.add_argument("--model-load-timeout", type=float, default=DEFAULT_MODEL_LOAD_TIMEOUT_S,
                        help="seconds a request for a model being loaded waits before 503 "
                             "(default: %(default)s)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (or set {API_KEY_ENV})")
    server.add_argument("--max-queue", type=int, default=None,
                        help="most sequences waiting for a batch slot; more get 503 + "
                             "Retry-After (default: no limit)")
    server.add_argument("--chat-template", default=None,
                        help="Jinja chat template file (default: the model's own)")
    server.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSER_CHOICES,
                        help="how tool calls are read from the model's text with tool_choice "
                             "'auto' (default: hermes, <tool_call>{json}</tool_call>; auto: "
                             "the one the chat template's conventions call for)")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES,
                        help="split a reasoning model's <think>...</think> off the answer "
                             "into reasoning_content: qwen3, deepseek_r1 (the prompt opens "
                             "the thinking), or auto (picked from the chat template); "
                             "default: none, the thinking stays in content")
    server.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                        help="output tokens a request may make when it gives no max_tokens "
                             "(max_completion_tokens, max_output_tokens), capped by the "
                             "room its prompt leaves; default: none, up to the context")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    server.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log every HTTP request")
    server.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                        help="what an hour of this server costs: /metrics then exports "
                             "pagoda:cost_usd_total, replica hours and cost per million "
                             "input and output tokens (default: no cost series)")
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
    server.add_argument("--record-traffic", default=None, metavar="FILE",
                        help="write one JSON line per completions/chat request to FILE "
                             "(arrival, body, token counts, server-side latencies), for "
                             "`pagoda bench ab` to replay; FILE is emptied at start")
    server.add_argument("--record-redact", action="store_true",
                        help="with --record-traffic: record placeholder text of the same "
                             "token counts instead of the prompts and messages")
    server.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE,
                        help="most responses kept for GET /v1/responses/{id} and "
                             "previous_response_id (the oldest go first; 0: keep none; "
                             "default: %(default)s)")
    server.add_argument("--responses-store-ttl", type=float, default=DEFAULT_STORE_TTL_S,
                        help="seconds a stored response is kept (default: %(default)s)")
    add_lora_args(server)


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
    models, names = args.model or [None], args.served_model_name or []
    if names and len(names) != len(models):
        raise ValueError(f"--served-model-name was given {len(names)} times for {len(models)} "
                         "--model: give one name per model, or none")
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name: names must differ, got {names}")
    if args.max_loaded_models is not None and args.max_loaded_models < len(models):
        raise ValueError(f"--max-loaded-models {args.max_loaded_models} is fewer than the "
                         f"{len(models)} models given with --model")
    if not args.model_load_timeout > 0:
        raise ValueError(f"--model-load-timeout must be > 0 seconds, got {args.model_load_timeout}")
    check_record_args(args.record_traffic, args.record_redact)
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if not args.responses_store_ttl > 0:
        raise ValueError(f"--responses-store-ttl must be > 0 seconds, got "
                         f"{args.responses_store_ttl}")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError(f"--max-tokens-default must be >= 1, got {args.max_tokens_default}")
    if args.cost_per_hour is not None:
        from pagoda.cost import check_cost_per_hour

        check_cost_per_hour(args.cost_per_hour)


def check_record_args(path: str | None, redact: bool) -> None:
    if redact and path is None:
        raise ValueError("--record-redact needs --record-traffic FILE (the record to redact)")
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"--record-traffic {path}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--record-traffic {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--record-traffic {path}: cannot write there")


