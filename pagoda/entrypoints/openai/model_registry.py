"""The models one server serves, loaded and unloaded while it serves.

Each served model is its own AsyncLLMEngine (own engine thread, KV cache, metrics), or with
--data-parallel-size N a DataParallelEngine (N engine processes, the same interface), with its
own serving objects; requests route by their `model` field. A model's life:

    loading ──> ready ──> draining ──> (gone: engine stopped, memory freed)
                  ^  (a reload of the same name builds the new engine while the old one
                  |   serves, swaps them, then the old one drains)

Invariants:
- Routing sees only ready models; a request for a name that is loading (and has no ready
  model) waits for the load, at most `load_timeout` seconds (then 503).
- A draining model takes no new request; its engine stops only once its last request ended
  (`ServedModel.active` == 0), so an unload or a swap never drops a request in flight.
- At least one model stays ready: the last one cannot be unloaded.
- At most `max_loaded_models` models are ready or loading: loading one more first drains
  the least recently used ready model (never the one being replaced).
- Every method runs on the server's event loop (building an engine goes to a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from pagoda.entrypoints.openai.protocol.errors import OpenAIError, model_not_found

if TYPE_CHECKING:  # `pagoda serve --help` must not import the engine (tests/entrypoints/test_cli.py)
    from pagoda.engine.loop.protocol import EngineClient

logger = logging.getLogger(__name__)

DEFAULT_MODEL_LOAD_TIMEOUT_S = 300.0


@dataclass
class ServedModel:
    name: str
    engine: EngineClient
    root: str
    """The model file or folder it was loaded from."""
    metrics: Any = None
    """Its EngineMetrics (its own Prometheus registry), or None."""
    serving: Any = None
    """What the routes call (RouteHandlers: completions, chat, embeddings), made by the
    registry."""
    created: int = field(default_factory=lambda: int(time.time()))
    state: str = "ready"
    """ready or draining."""
    active: int = 0
    """Requests being served (a stream counts until its response has ended)."""
    last_used: float = field(default_factory=time.monotonic)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever active == 0."""
    watcher: asyncio.Task | None = None
    lora: Any = None
    """Its LoRAConfig (pagoda/config.py); None or enable_lora off: no adapter may name it
    as its base (lora_registry.py)."""
    hf_config: Any = None
    """Its Hugging Face config, which adapters are checked against (None without LoRA)."""

    def __post_init__(self) -> None:
        self.idle.set()


ModelBuilder = Callable[[str, str, dict[str, Any]], ServedModel]
"""(served name, model path, engine options) -> a built ServedModel, engine not started.
Slow (loads weights): the registry runs it on a worker thread; whatever it raises becomes a
400 naming the path (a bad file or option is the usual cause)."""


class ModelRegistry:
    def __init__(
        self,
        make_serving: Callable[[ServedModel], Any],
        on_start: Callable[[ServedModel], None],
        builder: ModelBuilder | None = None,
        max_loaded_models: int | None = None,
        load_timeout: float = DEFAULT_MODEL_LOAD_TIMEOUT_S,
    ) -> None:
        """make_serving: the serving objects of a model; on_start: called once a model's
        engine runs (the server watches it for death); builder: for POST /v1/models/load
        (None: loading at run time is off)."""
        self._make_serving = make_serving
        self._on_start = on_start
        self.builder = builder
        self.max_loaded_models = max_loaded_models
        self.load_timeout = load_timeout
        self.ready: dict[str, ServedModel] = {}
        """Routable models, in the order they were loaded (the first is the default)."""
        self.loading: dict[str, asyncio.Future[ServedModel]] = {}
        self.draining: list[ServedModel] = []
        self.default_name: str | None = None

    # ---- models given at start-up ---------------------------------------------------------

    def add(self, model: ServedModel) -> None:
        """A model built before the server starts (its engine starts in `start`)."""
        model.serving = self._make_serving(model)
        self.ready[model.name] = model
        self.default_name = self.default_name or model.name

    def start(self) -> None:
        for model in self.ready.values():
            model.engine.start()
            self._on_start(model)

    def all_models(self) -> list[ServedModel]:
        return [*self.ready.values(), *self.draining]

    # ---- routing ---------------------------------------------------------------------------

    async def get(self, name: str | None) -> ServedModel:
        """The ready model of that name (None: the default), waiting for one being loaded."""
        if name is None:
            name = self.default_name if self.default_name in self.ready else next(iter(self.ready), None)
            if name is None:
                raise OpenAIError("No model is loaded.", HTTPStatus.SERVICE_UNAVAILABLE,
                                  "server_error", "model", "model_not_loaded")
        model = self.ready.get(name)
        if model is not None:
            return model
        pending = self.loading.get(name)
        if pending is None:
            raise model_not_found(name)
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.load_timeout)
        except TimeoutError:
            raise OpenAIError(
                f"The model `{name}` is still loading after {self.load_timeout:.0f}s; retry "
                "later.", HTTPStatus.SERVICE_UNAVAILABLE, "server_error", "model",
                "model_loading", headers={"Retry-After": "5"}) from None
        except OpenAIError:
            raise model_not_found(name) from None  # the load failed: the model is not there

    async def acquire(self, name: str | None) -> ServedModel:
        """`get`, and hold the model for one request (it will not stop under the request)
        until `release`."""
        model = await self.get(name)
        model.active += 1
        model.idle.clear()
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel) -> None:
        model.active -= 1
        if model.active == 0:
            model.idle.set()

    # ---- loading and unloading -------------------------------------------------------------

    async def load(self, name: str, path: str, options: dict[str, Any]) -> ServedModel:
        """Build a model and make it ready under `name`; a ready model of that name keeps
        serving until the new one is ready, then drains. Returns when ready."""
        if self.builder is None:
            raise OpenAIError("Loading models is off on this server.", HTTPStatus.FORBIDDEN,
                              "invalid_request_error", None, "model_loading_disabled")
        if name in self.loading:
            raise OpenAIError(f"The model `{name}` is already being loaded.",
                              HTTPStatus.CONFLICT, "invalid_request_error", "model",
                              "model_loading")
        pending: asyncio.Future[ServedModel] = asyncio.get_running_loop().create_future()
        self.loading[name] = pending
        try:
            self._evict_for(name)
            try:
                model = await asyncio.to_thread(self.builder, name, path, options)
            except Exception as e:  # noqa: BLE001 -- whatever the file or options got wrong
                logger.warning("loading %r from %s failed: %s: %s", name, path,
                               type(e).__name__, e)
                raise OpenAIError(f"Cannot load `{path}` as `{name}`: {e}",
                                  HTTPStatus.BAD_REQUEST, "invalid_request_error", "path",
                                  "model_load_failed") from None
            model.serving = self._make_serving(model)
            model.engine.start()
            self._on_start(model)
            old = self.ready.pop(name, None)
            self.ready[name] = model
            self.default_name = self.default_name or name
            if old is not None:
                self._drain(old)
            logger.info("model %r loaded from %s%s", name, path,
                        " (the previous one drains)" if old is not None else "")
            pending.set_result(model)
            return model
        except BaseException as e:
            pending.set_exception(e if isinstance(e, OpenAIError) else
                                  OpenAIError(str(e), HTTPStatus.INTERNAL_SERVER_ERROR))
            pending.exception()  # retrieved: waiters re-raise it; no "never retrieved" warning
            raise
        finally:
            del self.loading[name]

    async def unload(self, name: str) -> ServedModel:
        """Take a model out of routing; returns once its in-flight requests have ended and
        its engine has stopped."""
        if name not in self.ready:
            raise model_not_found(name)
        if len(self.ready) == 1 and not self.loading:
            raise OpenAIError(f"`{name}` is the only model loaded: load another first (a "
                              "server serves at least one).", HTTPStatus.CONFLICT,
                              "invalid_request_error", "model", "last_model")
        model = self.ready.pop(name)
        if self.default_name == name:
            self.default_name = next(iter(self.ready), None)
        await self._drain(model)
        return model

    def _evict_for(self, name: str) -> None:
        """Drain least recently used ready models until one more fits."""
        if self.max_loaded_models is None:
            return
        while True:
            loaded = len(self.loading) + len([n for n in self.ready if n != name])
            candidates = [m for m in self.ready.values() if m.name != name]
            if loaded <= self.max_loaded_models or not candidates:
                return
            victim = min(candidates, key=lambda m: m.last_used)
            logger.info("unloading the least recently used model %r (--max-loaded-models %d)",
                        victim.name, self.max_loaded_models)
            del self.ready[victim.name]
            if self.default_name == victim.name:
                self.default_name = next(iter(self.ready), None)
            self._drain(victim)

    def _drain(self, model: ServedModel) -> Awaitable[None]:
        """Stop routing to it; stop its engine once idle (a task: returned to await)."""
        model.state = "draining"
        self.draining.append(model)
        return asyncio.ensure_future(self._stop_when_idle(model))

    async def _stop_when_idle(self, model: ServedModel) -> None:
        await model.idle.wait()
        if model.watcher is not None:
            model.watcher.cancel()
            await asyncio.wait([model.watcher])  # (raises nothing)
        await model.engine.shutdown()
        self.draining.remove(model)
        logger.info("model %r stopped", model.name)
        # Whoever still holds the ServedModel must not keep its weights alive.
        model.engine = model.serving = model.metrics = model.watcher = None
        release_memory()

    async def shutdown(self) -> None:
        for model in self.all_models():
            if model.watcher is not None:
                model.watcher.cancel()
            await model.engine.shutdown()

    def cancel_all(self, reason: str) -> None:
        for model in self.all_models():
            model.engine.cancel_all(reason)


def release_memory() -> None:
    """Return freed memory (a stopped model's weights and KV cache) to the system: collect
    the cycles that still hold tensors (the engines' frozen start-up heaps included), then
    have glibc give back its free pages."""
    from pagoda.engine.loop.builder import collect_and_freeze
    from pagoda.executor.loader.heap import release_freed_memory

    collect_and_freeze()
    release_freed_memory()


def release_with_response(response: Response, release: Callable[[], None]) -> Response:
    """Call `release` once the response has been sent: for a stream, when its body ends
    (finished, failed, or closed because the client went away), or, should the body never
    be iterated at all, when it is garbage (exactly once in any case)."""
    if not isinstance(response, StreamingResponse):
        release()
        return response
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release()

    body = response.body_iterator

    async def body_then_release():
        try:
            async for chunk in body:
                yield chunk
        finally:
            release_once()

    response.body_iterator = body_then_release()
    loop = asyncio.get_running_loop()

    def release_from_any_thread() -> None:  # (the garbage collector runs on any thread)
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to release
            loop.call_soon_threadsafe(release_once)

    weakref.finalize(response.body_iterator, release_from_any_thread)
    return response
