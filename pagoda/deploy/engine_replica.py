"""One Ray Serve replica of the PagodaEngine deployment: the engine(s) and the FastAPI app of
`pagoda serve` (built by the same code: openai/api_server.build_server_state and server.build_app),
fed the requests the ingress forwards (forwarding.py).

Lifecycle (Ray Serve drives it):
- __init__: build and start the engines (slow; a bad model fails here, so Ray Serve marks
  the replica failed and, in a rolling upgrade, stops the rollout with the old replicas
  serving) and enter the app's lifespan (the model registry starts).
- handle: one request; yields ACCEPTED first, then what the app sends. Every response
  carries `x-pagoda-replica: <replica id>`.
- metrics: the page GET /metrics gives is also served on a port of its own, published for
  the driver's Prometheus targets file (replica_metrics.py): through the proxy, GET /metrics
  reaches one replica only.
- check_health (every --health-check-period s): raises once an engine loop died, so Ray
  Serve replaces the replica (its in-flight streams already ended with an error event).
- __del__ (graceful shutdown, after Ray Serve let in-flight requests finish for up to
  graceful_shutdown_timeout_s): refuse new work, withdraw the metrics port, leave the
  lifespan (engines stop).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from pagoda.deploy.forwarding import ACCEPTED, ForwardedRequest, play

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.server_state import ServerState

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-pagoda-replica"


def replica_tag() -> str:
    """This replica's id in Ray Serve ("" outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (unit tests)
        return ""


class PagodaEngine:
    """The deployment's class (app.py wraps it with serve.deployment)."""

    async def __init__(self, serve_args: dict,
                       build_state: Callable[[argparse.Namespace], ServerState]) -> None:
        """`build_state`: entrypoints/openai/api_server.build_server_state (passed in, by
        reference: the application is built with it, app.py and launch.py)."""
        from pagoda.deploy.replica_metrics import serve_replica_metrics
        from pagoda.entrypoints.openai.routes.admin import metrics_page
        from pagoda.entrypoints.openai.server import build_app

        logging.getLogger("pagoda").setLevel(logging.INFO)
        args = argparse.Namespace(**serve_args)
        self.state = build_state(args)
        self.app = build_app(self.state)
        self.tag = replica_tag().encode()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.metrics_server = serve_replica_metrics(metrics_page(self.state))
        logger.info("replica %s serving %r", self.tag.decode(), [m.name for m in self.state.models])

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[object]:
        yield ACCEPTED
        async for item in play(self.app, request):
            if isinstance(item, tuple):
                kind, status, headers = item
                item = (kind, status, [*headers, (REPLICA_HEADER, self.tag)])
            yield item

    def dead_engine_message(self) -> str | None:
        registry = self.state.registry
        for model in registry.all_models() if registry is not None else ():
            if model.engine is not None and not model.engine.is_alive:
                return f"model {model.name}: {model.engine.dead_message()}"
        return None

    async def check_health(self) -> None:
        message = self.dead_engine_message()
        if message is not None:
            raise RuntimeError(f"engine replica unhealthy: {message}")

    async def __del__(self) -> None:
        if not hasattr(self, "_lifespan"):
            return  # __init__ failed: nothing started that a lifespan would stop
        self.state.draining = True
        if getattr(self, "metrics_server", None) is not None:
            self.metrics_server.close()
        await self._lifespan.__aexit__(None, None, None)
