"""Running the app under uvicorn, with Pagoda's drain on SIGTERM/SIGINT (see
PagodaUvicornServer); server.py builds the app and its state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

from pagoda.entrypoints.openai.model_registry import ModelRegistry
from pagoda.entrypoints.openai.server_state import ServerState

logger = logging.getLogger(__name__)


class PagodaUvicornServer(uvicorn.Server):
    """uvicorn's server, except for the signal-initiated shutdown:
    - the app is marked as draining (new /v1 requests: 503) and uvicorn stops accepting;
    - requests still running `shutdown_timeout` seconds later are aborted by us, so their
      responses end with an error body or SSE error event rather than a cancelled task
      (uvicorn's own cancellation, a few seconds later, is only a fallback);
    - it ends normally (exit code 0): uvicorn itself re-raises the signal once done."""

    CANCEL_MARGIN_S = 5.0

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.pagoda_state = state
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        registry = self.pagoda_state.registry
        if not self.should_exit:
            logger.info("received %s: finishing in-flight requests (for up to %ss)",
                        signal.Signals(sig).name, self.shutdown_timeout)
            loop = live_engine_loop(registry)
            if loop is not None:
                reason = (f"the server shut down before this request finished (it waited "
                          f"{self.shutdown_timeout}s)")
                loop.call_soon_threadsafe(
                    loop.call_later, self.shutdown_timeout, registry.cancel_all, reason
                )
        self.pagoda_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def live_engine_loop(registry: ModelRegistry | None) -> asyncio.AbstractEventLoop | None:
    """The event loop of a model still running (ready or draining), or None. Not the start-up
    default's: /v1/models/load may have replaced it, its engine gone."""
    for model in registry.all_models() if registry is not None else ():
        loop = model.engine.loop if model.engine is not None else None
        if loop is not None and not loop.is_closed():
            return loop
    return None


def run_server(
    app: FastAPI, state: ServerState, host: str, port: int, shutdown_timeout: float,
    access_log: bool = True, ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain for up to `shutdown_timeout` seconds; HTTPS
    when a key and certificate are given. Returns the exit code: 0, or 1 when the engine
    loop died."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout + PagodaUvicornServer.CANCEL_MARGIN_S,
        lifespan="on", ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
    )
    server = PagodaUvicornServer(config, state, shutdown_timeout)
    state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    return state.exit_code
