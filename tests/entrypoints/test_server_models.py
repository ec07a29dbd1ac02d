"""Several models in one server, loaded and unloaded while serving (issue 20, item 2), over
fake engines: routing by `model`, load / unload / reload through the API, the
least-recently-used eviction, waiting for a model being loaded, and that neither an unload
nor a reload stops an engine under a request in flight."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from fastapi.testclient import TestClient

from pagoda.entrypoints.openai.model_registry import ModelRegistry, ServedModel
from pagoda.entrypoints.openai.protocol.errors import OpenAIError
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from tests.entrypoints.test_serving_pipeline import FakeAsyncEngine

KEY = "sk-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Engine(FakeAsyncEngine):
    def __init__(self, path: str = "/m") -> None:
        super().__init__()
        self.path = path
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.stopped = True

    async def wait_dead(self) -> BaseException:
        await asyncio.Event().wait()  # never dies

    def cancel_all(self, reason: str) -> None:
        pass


class Builder:
    """A model builder that records what it built; a path containing "bad" fails, and
    `gate` (when set) holds the build until it is set."""

    def __init__(self) -> None:
        self.built: dict[str, Engine] = {}
        self.gate: threading.Event | None = None

    def __call__(self, name: str, path: str, options: dict) -> ServedModel:
        if self.gate is not None:
            assert self.gate.wait(30)
        if "bad" in path:
            raise ValueError(f"{path}: not a GGUF file or model folder")
        engine = self.built[name] = Engine(path)
        return ServedModel(name, engine, path)


def make_client(builder: Builder, api_key: str | None = KEY, **kwargs) -> TestClient:
    state = ServerState(models=[ServedModel("first", Engine(), "/first")],
                        model_builder=builder, api_key=api_key, **kwargs)
    return TestClient(build_app(state))


def complete(client: TestClient, model: str | None, **extra) -> dict:
    body = {"prompt": "hi", "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return client.post("/v1/completions", json=body, headers=AUTH)


def model_states(client: TestClient) -> dict[str, str]:
    return {card["id"]: card["state"]
            for card in client.get("/v1/models", headers=AUTH).json()["data"]}


def test_load_route_unload():
    builder = Builder()
    with make_client(builder) as client:
        response = client.post("/v1/models/load", headers=AUTH,
                               json={"model": "second", "path": "/models/second.gguf"})
        assert response.status_code == 200, response.text
        assert response.json()["state"] == "ready"
        assert response.json()["root"] == "/models/second.gguf"
        assert builder.built["second"].started
        assert model_states(client) == {"first": "ready", "second": "ready"}
        # routing by the `model` field; none: the first model
        assert complete(client, "second").json()["model"] == "second"
        assert len(builder.built["second"].added) == 1
        assert complete(client, None).json()["model"] == "first"
        assert len(builder.built["second"].added) == 1
        response = client.post("/v1/models/unload", headers=AUTH, json={"model": "second"})
        assert response.status_code == 200, response.text
        assert response.json()["state"] == "unloaded"
        assert builder.built["second"].stopped
        assert model_states(client) == {"first": "ready"}
        error = complete(client, "second").json()["error"]
        assert error["code"] == "model_not_found"


def test_admin_errors():
    builder = Builder()
    with make_client(builder) as client:
        bad = client.post("/v1/models/load", headers=AUTH,
                          json={"model": "x", "path": "/models/bad.gguf"})
        assert bad.status_code == 400
        assert "/models/bad.gguf" in bad.json()["error"]["message"]
        assert model_states(client) == {"first": "ready"}
        no_path = client.post("/v1/models/load", headers=AUTH, json={"model": "x"})
        assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "path"
        unknown = client.post("/v1/models/unload", headers=AUTH, json={"model": "nope"})
        assert unknown.status_code == 404
        last = client.post("/v1/models/unload", headers=AUTH, json={"model": "first"})
        assert last.status_code == 409 and last.json()["error"]["code"] == "last_model"
        assert model_states(client) == {"first": "ready"}
        assert client.post("/v1/models/load", json={"model": "x", "path": "/p"}).status_code == 401
        extra = client.post("/v1/models/load", headers=AUTH, json={"model": "x", "paht": "/p"})
        assert extra.status_code == 400
    with make_client(builder, api_key=None) as client:
        response = client.post("/v1/models/load", json={"model": "x", "path": "/p"})
        assert response.status_code == 403
        assert "--api-key" in response.json()["error"]["message"]
        assert "x" not in builder.built


def test_reload_keeps_the_name_and_drains_the_old_engine():
    builder = Builder()
    with make_client(builder) as client:
        client.post("/v1/models/load", headers=AUTH, json={"model": "m", "path": "/v1.gguf"})
        old = builder.built["m"]
        response = client.post("/v1/models/load", headers=AUTH, json={"model": "m"})
        assert response.status_code == 200 and response.json()["root"] == "/v1.gguf"
        new = builder.built["m"]
        assert new is not old and old.stopped and not new.stopped
        complete(client, "m")
        assert len(new.added) == 1 and not old.added


def test_least_recently_used_model_is_unloaded_when_full():
    builder = Builder()
    with make_client(builder, max_loaded_models=2) as client:
        client.post("/v1/models/load", headers=AUTH, json={"model": "a", "path": "/a"})
        complete(client, "first")  # "a" is now the least recently used
        client.post("/v1/models/load", headers=AUTH, json={"model": "b", "path": "/b"})
        assert model_states(client) == {"first": "ready", "b": "ready"}
        assert builder.built["a"].stopped


def registry_with(builder: Builder, **kwargs) -> ModelRegistry:
    registry = ModelRegistry(lambda model: None, lambda model: None, builder, **kwargs)
    return registry


def test_unload_and_reload_wait_for_requests_in_flight():
    async def scenario() -> None:
        builder = Builder()
        registry = registry_with(builder)
        await registry.load("m", "/one", {})
        await registry.load("other", "/other", {})  # (the last model cannot be unloaded)
        held = await registry.acquire("m")  # a request in flight on the first engine
        first = builder.built["m"]
        await registry.load("m", "/two", {})  # a reload swaps at once ...
        assert (await registry.get("m")).engine is builder.built["m"]
        await asyncio.sleep(0.05)
        assert not first.stopped  # ... but the old engine serves its request to the end
        registry.release(held)
        await asyncio.sleep(0.05)
        assert first.stopped and registry.draining == []

        held = await registry.acquire("m")
        unload = asyncio.ensure_future(registry.unload("m"))
        await asyncio.sleep(0.05)
        assert not unload.done() and not builder.built["m"].stopped
        with pytest.raises(OpenAIError) as refused:
            await registry.get("m")  # no new request reaches a draining model
        assert refused.value.status == 404
        registry.release(held)
        await asyncio.wait_for(unload, 5)
        assert held.engine is None  # its engine is let go (memory can be returned)

    asyncio.run(scenario())


def test_requests_wait_for_a_model_being_loaded():
    async def scenario() -> None:
        builder = Builder()
        builder.gate = threading.Event()
        registry = registry_with(builder, load_timeout=0.2)
        load = asyncio.ensure_future(registry.load("m", "/m", {}))
        await asyncio.sleep(0.05)
        with pytest.raises(OpenAIError) as timed_out:
            await registry.get("m")  # still loading after the timeout: 503, not 404
        assert timed_out.value.status == 503 and timed_out.value.code == "model_loading"
        registry.load_timeout = 10
        waiting = asyncio.ensure_future(registry.get("m"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        builder.gate.set()
        model = await asyncio.wait_for(waiting, 10)
        assert model.engine is builder.built["m"] and (await load) is model

        builder.gate = None
        failing = asyncio.ensure_future(registry.load("x", "/bad", {}))
        with pytest.raises(OpenAIError) as failed:
            await registry.get("x") if not failing.done() else await failing
        assert failed.value.status in (400, 404)
        with pytest.raises(OpenAIError):
            await failing

    asyncio.run(scenario())


def test_a_stream_releases_its_model_once_whether_read_or_dropped():
    from fastapi.responses import StreamingResponse

    from pagoda.entrypoints.openai.model_registry import release_with_response

    async def body():
        yield b"data: 1\n\n"

    async def scenario() -> list[str]:
        released: list[str] = []
        read = release_with_response(StreamingResponse(body()), lambda: released.append("read"))
        assert [chunk async for chunk in read.body_iterator] == [b"data: 1\n\n"]
        del read
        dropped = release_with_response(StreamingResponse(body()),
                                        lambda: released.append("dropped"))
        assert released == ["read"]
        del dropped  # never sent (the client left first): released when it is garbage
        gc.collect()
        await asyncio.sleep(0)  # (released on the event loop)
        return released

    assert asyncio.run(scenario()) == ["read", "dropped"]
