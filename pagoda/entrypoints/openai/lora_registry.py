"""The LoRA adapters a server serves: names a request's `model` may give besides the served
models, each over one served base model (issue 35).

    --lora-modules name=path ...         added at start (lora_args.py checked them already)
    POST /v1/load_lora_adapter           added while serving (path inside --lora-allowed-paths)
    POST /v1/unload_lora_adapter         removed: new requests get 404; those running finish,
                                         then the base engine frees it (engine.remove_lora)

Invariants:
- Adapter names and served model names are one namespace: an adapter never shadows a model
  and two adapters never share a name.
- Each adapter gets a fresh `lora_int_id` (never reused while the server runs), so a name
  unloaded and loaded again from another file never meets the old one's cached KV blocks or
  loaded weights in the engine.
- An adapter routes only while its base model is ready and has LoRA on (--enable-lora);
  otherwise its name is an unknown model (404), as every name that is not served.
- Every refusal is an OpenAIError 400 naming the problem (code lora_*), except the API key
  (the server's check_admin: 403 without --api-key, 401 for a wrong key).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from pagoda.entrypoints.openai.model_registry import ModelRegistry, ServedModel
from pagoda.entrypoints.openai.protocol.errors import OpenAIError, bad_request, model_not_found
from pagoda.entrypoints.openai.protocol.responses import ModelCard
from pagoda.entrypoints.openai.serving.job import ServedAs
from pagoda.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class ServedAdapter:
    request: LoRARequest
    """lora_name is the served name; base_model_name the served base model's name."""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def base(self) -> str:
        assert self.request.base_model_name is not None
        return self.request.base_model_name

    @property
    def served_as(self) -> ServedAs:
        """What the base model's handlers serve its requests as: `model` in the responses
        is the adapter's name, and every engine request carries its LoRARequest."""
        return ServedAs(self.request.lora_name, self.request)


class LoRARegistry:
    def __init__(self, models: ModelRegistry, allowed_paths: tuple[str, ...] = ()) -> None:
        """`models`: the server's models (the bases); `allowed_paths`: the directories
        POST /v1/load_lora_adapter may read (--lora-allowed-paths; none: loading is off)."""
        self.models = models
        self.allowed_paths = allowed_paths
        self.adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)

    # ---- routing ---------------------------------------------------------------------------

    def routable(self, name: str | None) -> ServedAdapter | None:
        """The adapter `name` names, if its base serves it now."""
        adapter = self.adapters.get(name) if name is not None else None
        if adapter is None:
            return None
        base = self.models.ready.get(adapter.base)
        if base is None or not lora_enabled(base):
            return None
        return adapter

    def cards(self) -> list[ModelCard]:
        """/v1/models' entries of the routable adapters, as vLLM lists them."""
        cards = []
        for name in self.adapters:
            adapter = self.routable(name)
            if adapter is not None:
                base = self.models.ready[adapter.base]
                cards.append(ModelCard(
                    id=name, created=adapter.created, root=adapter.request.lora_path,
                    parent=adapter.base, state="ready",
                    max_model_len=base.engine.max_model_len if base.engine else None))
        return cards

    # ---- adding and removing ---------------------------------------------------------------

    def add(self, name: str, path: str, base: str | None = None) -> ServedAdapter:
        """Check and add an adapter over `base` (None: the default model), at start; the
        files are read (headers only). Raises OpenAIError 400 naming the problem."""
        adapter, old = self._insert(self._checked(name, path, base, False), False)
        assert old is None
        return adapter

    async def load(self, name: str, path: str, base: str | None = None, *,
                   replace: bool = False) -> ServedAdapter:
        """POST /v1/load_lora_adapter: `path` must lie inside --lora-allowed-paths; the
        files are read on a worker thread."""
        from pagoda.lora.adapter_checks import resolve_allowed_path
        from pagoda.lora.adapter_files import LoRAAdapterError

        try:
            real_path = resolve_allowed_path(path, self.allowed_paths)
        except LoRAAdapterError as e:
            raise bad_request(str(e), "lora_path", "lora_path_not_allowed") from None
        self._check_name(name, base, replace)  # the cheap refusals first, on the loop
        request = await asyncio.to_thread(self._checked, name, real_path, base, replace)
        adapter, old = self._insert(request, replace)
        if old is not None:
            await self._forget(old)
        return adapter

    async def remove(self, name: str, lora_int_id: int | None = None) -> ServedAdapter:
        """POST /v1/unload_lora_adapter: new requests naming it get 404 at once; the base
        engine frees it once its running requests end."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise bad_request(f"The LoRA adapter `{name}` is not loaded (GET /v1/models lists "
                              "the adapters).", "lora_name", "lora_not_found")
        if lora_int_id is not None and lora_int_id != adapter.request.lora_int_id:
            raise bad_request(f"The LoRA adapter `{name}` has lora_int_id "
                              f"{adapter.request.lora_int_id}, not {lora_int_id}.",
                              "lora_int_id", "lora_not_found")
        del self.adapters[name]
        await self._forget(adapter)
        return adapter

    async def _forget(self, adapter: ServedAdapter) -> None:
        """Tell the base engine the adapter is gone: it refuses new requests of it, lets
        those in flight finish, then frees it (EngineClient.remove_lora). Routing stopped
        already (the name left `adapters` first)."""
        base = self.models.ready.get(adapter.base)
        if base is not None and base.engine is not None:
            await base.engine.remove_lora(adapter.request.lora_int_id)
        logger.info("LoRA adapter %r (id %d) unloaded", adapter.request.lora_name,
                    adapter.request.lora_int_id)

    def _checked(self, name: str, path: str, base: str | None,
                 replace: bool) -> LoRARequest:
        """The LoRARequest of a new adapter, its files read and checked against its base
        (no state changes: runs on a worker thread for a load)."""
        from pagoda.lora.adapter_checks import check_lora_request
        from pagoda.lora.adapter_files import LoRAAdapterError

        base_model = self._check_name(name, base, replace)
        request = LoRARequest(name, next(self._ids), path, base_model.name)
        try:
            check_lora_request(request, base_model.hf_config, base_model.lora)
        except LoRAAdapterError as e:
            raise bad_request(str(e), "lora_path", "lora_invalid") from None
        return request

    def _insert(self, request: LoRARequest,
                replace: bool) -> tuple[ServedAdapter, ServedAdapter | None]:
        """Route `name` to the new adapter; returns it and the one it replaced (for the
        caller to _forget)."""
        name = request.lora_name
        self._check_name(name, request.base_model_name, replace)  # (a load raced us)
        old = self.adapters.get(name)
        adapter = self.adapters[name] = ServedAdapter(request)
        logger.info("LoRA adapter %r (id %d) over %r from %s", name, request.lora_int_id,
                    adapter.base, request.lora_path)
        return adapter, old

    def _check_name(self, name: str, base: str | None, replace: bool) -> ServedModel:
        """The base model an adapter `name` may be added over, or a 400: the name is free
        (or `replace`), the base is served and has LoRA on."""
        if name in self.models.ready or name in self.models.loading:
            raise bad_request(f"`{name}` is the name of a served model; give the adapter "
                              "another name", "lora_name", "lora_name_taken")
        if name in self.adapters and not replace:
            raise bad_request(f"The LoRA adapter `{name}` is already loaded (unload it first, "
                              "or send load_inplace: true to replace it).", "lora_name",
                              "lora_name_taken")
        base = base or self.models.default_name
        model = self.models.ready.get(base) if base is not None else None
        if model is None:
            raise bad_request(f"LoRA adapter `{name}`: its base model `{base}` is not served",
                              "base_model_name", "lora_base_not_found")
        if not lora_enabled(model):
            raise bad_request(f"LoRA adapter `{name}`: LoRA adapters are off for the model "
                              f"`{model.name}`; start the server with --enable-lora",
                              "lora_name", "lora_disabled")
        return model


def lora_enabled(model: ServedModel) -> bool:
    return model.lora is not None and model.lora.enable_lora


def adapter_not_found(name: str, error: OpenAIError) -> OpenAIError:
    """A 404 about the base of adapter `name` says the adapter's name instead."""
    return model_not_found(name) if error.status == 404 else error
