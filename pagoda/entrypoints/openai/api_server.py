"""The server assembled from checked `pagoda serve` flags (server_args.py): every --model's
engine built and started, the ServerState that build_app (server.py) serves. `pagoda serve`
(cli/serve.py) runs it on uvicorn with run_api_server; each Ray Serve engine replica
(pagoda/deploy/) builds its state with the same build_server_state.

Lifecycle of run_api_server: load the models on their engine threads (slow), log the URL,
the models and the KV capacity, serve. On SIGTERM or SIGINT: refuse new /v1 requests (503;
uvicorn also stops accepting connections), let in-flight ones finish for up to
--shutdown-timeout seconds, cancel (abort) the rest, stop the engine thread (with
--data-parallel-size N: the N replica processes), exit 0. A second SIGINT quits at once. If
the engine loop dies: open streams end with an error event, /health says 503, and two
seconds later the server shuts down and exits 1 (for a supervisor to restart it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from pagoda.config import EngineConfig
from pagoda.config_args import option_values
from pagoda.entrypoints.openai.lora_args import base_hf_config, check_lora_args
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server_args import API_KEY_ENV
from pagoda.entrypoints.openai.server_state import ServerState

logger = logging.getLogger(__name__)


def model_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One EngineConfig per --model (the bundled model when none), the other engine flags
    shared; ValueError for a bad value."""
    configs = []
    for model in args.model or [None]:
        one = argparse.Namespace(**{**vars(args), "model": model})
        configs.append(EngineConfig.from_cli_args(one))
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
                              max_queue: int | None) -> ServedModel:
    """--data-parallel-size N: N engine processes behind this server
    (pagoda/engine/data_parallel/); returns its ServedModel, engine not started."""
    from pagoda.engine.data_parallel.engine import DataParallelEngine
    from pagoda.engine.data_parallel.metrics import DataParallelMetrics

    engine = DataParallelEngine(config, max_queue=max_queue)
    name = name or engine.model_files.name
    metrics = engine.metrics = DataParallelMetrics(name, engine.num_replicas)
    logger.info("model %r: %d replicas, KV cache capacity %d tokens each, max_model_len %d",
                name, engine.num_replicas, engine.kv_capacity_tokens, engine.max_model_len)
    return ServedModel(name, engine, engine.model_files.path, metrics, lora=config.lora,
                       hf_config=base_hf_config(config) if config.lora.enable_lora else None)


def build_model(name: str | None, config: EngineConfig, max_queue: int | None) -> ServedModel:
    """One served model: its engine built on its engine thread (slow), not started."""
    if config.parallel.data_parallel_size > 1:
        return build_data_parallel_model(name, config, max_queue)
    from pagoda.engine.loop.async_engine import AsyncLLMEngine
    from pagoda.engine.loop.builder import build_engine
    from pagoda.engine.stats.metrics import EngineMetrics

    async_engine = AsyncLLMEngine.build_on_engine_thread(
        lambda: build_engine(config), max_queue=max_queue,
    )
    engine = async_engine.engine
    name = name or engine.model_files.name
    metrics = EngineMetrics(name)
    async_engine.metrics = metrics  # used by the loop from start() on
    logger.info("model %r: KV cache capacity %d tokens, max_model_len %d", name,
                engine.kv_capacity_tokens, engine.max_model_len)
    return ServedModel(name, async_engine, engine.model_files.path, metrics,
                       lora=config.lora, hf_config=engine.hf_config)


def build_server_state(args: argparse.Namespace) -> ServerState:
    """The ServerState of checked `pagoda serve` flags: every --model's engine built (slow),
    the first the default; what run_api_server serves, and what each Ray Serve replica
    serves (pagoda/deploy/engine_replica.py)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from pagoda.entrypoints.openai.responses_api.store import ResponseStore

    configs = model_configs(args)
    lora_modules = check_lora_args(args, configs)  # (before anything slow)
    chat_template = read_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    pagoda_logger = logging.getLogger("pagoda")
    if pagoda_logger.getEffectiveLevel() > logging.INFO:
        pagoda_logger.setLevel(logging.INFO)  # a server reports its start-up and shutdown

    def build_loaded_model(name: str, path: str, options: dict) -> ServedModel:
        """POST /v1/models/load: the server's engine flags, then the request's options."""
        kwargs = {**option_values(EngineConfig, args), "model": path, **options}
        if isinstance(kwargs.get("speculative_config"), dict):
            kwargs["speculative_config"] = json.dumps(kwargs["speculative_config"])
        return build_model(name, EngineConfig.from_kwargs(**kwargs), args.max_queue)

    names = args.served_model_name or [None] * len(configs)
    models: list[ServedModel] = []
    for name, config in zip(names, configs):
        model = build_model(name, config, args.max_queue)
        if any(m.name == model.name for m in models):
            raise ValueError(f"two models are served as {model.name!r}: give each its own "
                             "--served-model-name")
        models.append(model)
    server_registry = CollectorRegistry()
    # process_resident_memory_bytes, CPU seconds, open fds (as vLLM): what a soak watches
    ProcessCollector(registry=server_registry)
    state = ServerState(
        models=models, model_builder=build_loaded_model,
        lora_modules=tuple(lora_modules),
        lora_allowed_paths=tuple(args.lora_allowed_paths or ()),
        max_loaded_models=args.max_loaded_models, model_load_timeout=args.model_load_timeout,
        server_registry=server_registry, api_key=api_key, chat_template=chat_template,
        tool_call_parser=args.tool_call_parser, max_request_bytes=args.max_request_bytes,
        reasoning_parser=args.reasoning_parser, default_max_tokens=args.max_tokens_default,
        request_timeout=args.request_timeout, allowed_origins=tuple(args.allowed_origins),
        record_traffic=args.record_traffic, record_redact=args.record_redact,
        responses_store=ResponseStore(args.responses_store_size, args.responses_store_ttl),
    )
    if args.cost_per_hour is not None:  # cost series (`state` is read at scrape time)
        from pagoda.entrypoints.openai.cost_metrics import CostCollector, served_model_registries

        server_registry.register(
            CostCollector(args.cost_per_hour, lambda: served_model_registries(state)))
    return state


def run_api_server(args: argparse.Namespace) -> int:
    """`pagoda serve` without --ray-serve: build the state, serve it on uvicorn until
    SIGTERM/SIGINT (or the engine's death); the process's exit code."""
    import pagoda
    from pagoda.entrypoints.openai.server import build_app
    from pagoda.entrypoints.openai.uvicorn_server import run_server

    state = build_server_state(args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if args.ssl_certfile else "http"
    logger.info(
        "Pagoda %s serving %s on %s://%s:%d (API key %s)", pagoda.__version__,
        ", ".join(repr(model.name) for model in state.models), scheme, host, args.port,
        "required" if state.api_key else "not required",
    )
    exit_code = run_server(build_app(state), state, args.host, args.port,
                           args.shutdown_timeout, access_log=args.access_log,
                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    logger.info("Pagoda server stopped")
    return exit_code
