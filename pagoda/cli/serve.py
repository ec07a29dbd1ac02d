"""`pagoda serve`: the OpenAI-compatible server on uvicorn.

Lifecycle: check the flags and build the EngineConfig (a bad value fails before anything slow),
load the model on the engine thread (slow), log the URL, the model and the KV capacity, serve.
On SIGTERM or SIGINT: refuse new /v1 requests (503; uvicorn also stops accepting connections),
let in-flight ones finish for up to --shutdown-timeout seconds, cancel (abort) the rest,
stop the engine thread (with --data-parallel-size N: the N replica processes), exit 0. A second SIGINT quits at once. If the engine loop dies: open
streams end with an error event, /health says 503, and two seconds later the server shuts
down and exits 1 (for a supervisor to restart it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from pagoda.cli.serve_lora import add_lora_args, base_hf_config, check_lora_args
from pagoda.cli.shared_args import add_engine_args, engine_config, engine_kwargs
from pagoda.config import EngineConfig
from pagoda.deploy.options import add_ray_serve_args, check_ray_serve_args
from pagoda.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES
from pagoda.entrypoints.openai.model_registry import DEFAULT_MODEL_LOAD_TIMEOUT_S
from pagoda.entrypoints.openai.responses_api.store import DEFAULT_STORE_SIZE, DEFAULT_STORE_TTL_S
from pagoda.entrypoints.reasoning.auto import REASONING_PARSER_CHOICES
from pagoda.entrypoints.tools.parsers import TOOL_PARSER_CHOICES

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGODA_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
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
    add_ray_serve_args(parser)
    add_engine_args(parser, repeatable=("model",))
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
    check_ray_serve_args(args)
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if not args.responses_store_ttl > 0:
        raise ValueError(f"--responses-store-ttl must be > 0 seconds, got "
                         f"{args.responses_store_ttl}")
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


def model_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One EngineConfig per --model (the bundled model when none), the other engine flags
    shared; ValueError for a bad value."""
    configs = []
    for model in args.model or [None]:
        one = argparse.Namespace(**{**vars(args), "model": model})
        configs.append(engine_config(one))
    return configs


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e.strerror})") from None


def build_data_parallel_model(name: str | None, config: EngineConfig,
                              max_queue: int | None):
    """--data-parallel-size N: N engine processes behind this server
    (pagoda/engine/data_parallel/); returns its ServedModel, engine not started."""
    from pagoda.engine.data_parallel.engine import DataParallelEngine
    from pagoda.engine.data_parallel.metrics import DataParallelMetrics
    from pagoda.entrypoints.openai.model_registry import ServedModel

    engine = DataParallelEngine(config, max_queue=max_queue)
    name = name or engine.model_files.name
    metrics = engine.metrics = DataParallelMetrics(name, engine.num_replicas)
    logger.info("model %r: %d replicas, KV cache capacity %d tokens each, max_model_len %d",
                name, engine.num_replicas, engine.kv_capacity_tokens, engine.max_model_len)
    return ServedModel(name, engine, engine.model_files.path, metrics, lora=config.lora,
                       hf_config=base_hf_config(config) if config.lora.enable_lora else None)


def run_serve(args: argparse.Namespace) -> int:
    import pagoda
    from pagoda.entrypoints.openai.server import build_app
    from pagoda.entrypoints.openai.uvicorn_server import run_server

    check_server_args(args)
    if getattr(args, "ray_serve", False):
        from pagoda.deploy.launch import run_ray_serve

        check_lora_args(args, model_configs(args))  # here, not first in every replica
        return run_ray_serve(args, build_server_state)
    state = build_server_state(args)
    models = [state.model_name] + [m.name for m in state.more_models]
    api_key = state.api_key
    host = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if args.ssl_certfile else "http"
    logger.info(
        "Pagoda %s serving %s on %s://%s:%d (API key %s)", pagoda.__version__,
        ", ".join(repr(name) for name in models), scheme, host, args.port,
        "required" if api_key else "not required",
    )
    exit_code = run_server(build_app(state), state, args.host, args.port,
                           args.shutdown_timeout, access_log=args.access_log,
                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    logger.info("Pagoda server stopped")
    return exit_code


def build_server_state(args: argparse.Namespace):
    """The ServerState of checked `pagoda serve` flags: every --model's engine built (slow)
    and started on its engine thread; what run_serve serves, and what each Ray Serve replica
    serves (pagoda/deploy/engine_replica.py)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from pagoda.entrypoints.openai.model_registry import ServedModel
    from pagoda.entrypoints.openai.responses_api.store import ResponseStore
    from pagoda.entrypoints.openai.server import ServerState

    configs = model_configs(args)
    lora_modules = check_lora_args(args, configs)  # (before anything slow)
    chat_template = read_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    pagoda_logger = logging.getLogger("pagoda")
    if pagoda_logger.getEffectiveLevel() > logging.INFO:
        pagoda_logger.setLevel(logging.INFO)  # a server reports its start-up and shutdown

    def build_model(name: str | None, config: EngineConfig) -> ServedModel:
        if config.parallel.data_parallel_size > 1:
            return build_data_parallel_model(name, config, args.max_queue)
        from pagoda.engine.loop.async_engine import AsyncLLMEngine
        from pagoda.engine.loop.builder import build_engine
        from pagoda.engine.stats.metrics import EngineMetrics

        async_engine = AsyncLLMEngine.build_on_engine_thread(
            lambda: build_engine(config), max_queue=args.max_queue,
        )
        engine = async_engine.engine
        name = name or engine.model_files.name
        metrics = EngineMetrics(name)
        async_engine.metrics = metrics  # used by the loop from start() on
        logger.info("model %r: KV cache capacity %d tokens, max_model_len %d", name,
                    engine.kv_capacity_tokens, engine.max_model_len)
        return ServedModel(name, async_engine, engine.model_files.path, metrics,
                           lora=config.lora, hf_config=engine.hf_config)

    def build_loaded_model(name: str, path: str, options: dict) -> ServedModel:
        """POST /v1/models/load: the server's engine flags, then the request's options."""
        kwargs = {**engine_kwargs(args), "model": path, **options}
        if isinstance(kwargs.get("speculative_config"), dict):
            kwargs["speculative_config"] = json.dumps(kwargs["speculative_config"])
        return build_model(name, EngineConfig.from_kwargs(**kwargs))

    names = args.served_model_name or [None] * len(configs)
    models = []
    for name, config in zip(names, configs):
        model = build_model(name, config)
        if any(m.name == model.name for m in models):
            raise ValueError(f"two models are served as {model.name!r}: give each its own "
                             "--served-model-name")
        models.append(model)
    first = models[0]
    server_registry = CollectorRegistry()
    # process_resident_memory_bytes, CPU seconds, open fds (as vLLM): what a soak watches
    ProcessCollector(registry=server_registry)
    if args.cost_per_hour is not None:  # cost series (`state` is read at scrape time)
        from pagoda.entrypoints.openai.cost_metrics import CostCollector, served_model_registries

        server_registry.register(
            CostCollector(args.cost_per_hour, lambda: served_model_registries(state)))
    state = ServerState(
        engine=first.engine, metrics=first.metrics, model_name=first.name,
        model_root=first.root, more_models=models[1:], model_builder=build_loaded_model,
        model_lora=first.lora, model_hf_config=first.hf_config,
        lora_modules=tuple(lora_modules),
        lora_allowed_paths=tuple(args.lora_allowed_paths or ()),
        max_loaded_models=args.max_loaded_models, model_load_timeout=args.model_load_timeout,
        server_registry=server_registry, api_key=api_key, chat_template=chat_template,
        tool_call_parser=args.tool_call_parser, max_request_bytes=args.max_request_bytes,
        reasoning_parser=args.reasoning_parser,
        request_timeout=args.request_timeout, allowed_origins=tuple(args.allowed_origins),
        record_traffic=args.record_traffic, record_redact=args.record_redact,
        responses_store=ResponseStore(args.responses_store_size, args.responses_store_ttl),
    )
    return state
