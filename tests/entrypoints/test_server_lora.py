"""LoRA adapters on the server (issue 35), over fake engines and real adapter files made by
`peft`: a request's `model` naming an adapter runs its base engine with the adapter's
LoRARequest on every OpenAI route, /v1/models lists adapters with root and parent, and
POST /v1/load_lora_adapter / /v1/unload_lora_adapter behind the API key, each refusal a
400 naming the problem. (The forward with adapters is the executor's: tests/lora/.)"""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient
from transformers import LlamaConfig

from pagoda.config import LoRAConfig
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app, served_engines
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.lora.lora_modules import LoRAModule
from pagoda.lora.request import LoRARequest
from tests.entrypoints.test_server_models import Engine
from tests.executor.tiny_checkpoints import COMMON
from tests.lora.peft_adapters import base_model, make_adapter

KEY = "sk-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}
LORA = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16)


class LoRAEngine(Engine):
    """A fake engine that records the adapters it was told to free."""

    def __init__(self, path: str = "/m") -> None:
        super().__init__(path)
        self.removed_loras: list[int] = []

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.removed_loras.append(lora_int_id)
        return True


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Adapter folders: `allowed/` holds what the server may load at run time."""
    root = tmp_path_factory.mktemp("loras")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    paths = {
        "alpha": str(allowed / "alpha"),
        "beta": str(allowed / "beta"),
        "rank32": str(allowed / "rank32"),
        "other_shape": str(allowed / "other_shape"),
        "embed": str(allowed / "embed"),
        "outside": str(outside / "gamma"),
    }
    make_adapter(paths["alpha"], base_model(), seed=1)
    make_adapter(paths["beta"], base_model(), seed=2, target_modules=["q_proj", "v_proj"])
    make_adapter(paths["rank32"], base_model(), r=32)
    make_adapter(paths["other_shape"], base_model(intermediate_size=48))
    make_adapter(paths["embed"], base_model(), target_modules=["q_proj", "embed_tokens"])
    make_adapter(paths["outside"], base_model())
    os.symlink(paths["outside"], allowed / "link_out")
    paths.update(allowed=str(allowed), link_out=str(allowed / "link_out"),
                 dotdot=str(allowed / ".." / "outside" / "gamma"),
                 missing=str(allowed / "missing"))
    return paths


def make_client(adapters, *, api_key: str | None = KEY, lora=LORA,
                allowed: tuple[str, ...] | None = None, modules=None,
                more_models=(), **kwargs) -> TestClient:
    base = ServedModel("base", LoRAEngine(), "/base", lora=lora,
                       hf_config=LlamaConfig(**COMMON))
    state = ServerState(
        models=[base, *more_models], api_key=api_key,
        lora_modules=(LoRAModule("alpha", adapters["alpha"]),) if modules is None else modules,
        lora_allowed_paths=(adapters["allowed"],) if allowed is None else allowed, **kwargs)
    return TestClient(build_app(state))


def engine_of(client: TestClient) -> LoRAEngine:
    return client.app.state.pagoda.default_model.engine


def load(client: TestClient, name: str, path: str, **extra):
    return client.post("/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": name, "lora_path": path, **extra})


def unload(client: TestClient, name: str, **extra):
    return client.post("/v1/unload_lora_adapter", headers=AUTH,
                       json={"lora_name": name, **extra})


def complete(client: TestClient, model: str | None):
    body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
    return client.post("/v1/completions", json=body, headers=AUTH)


def cards(client: TestClient) -> dict[str, dict]:
    return {card["id"]: card for card in client.get("/v1/models", headers=AUTH).json()["data"]}


def test_models_list_the_adapters_with_root_and_parent(adapters):
    with make_client(adapters) as client:
        listed = cards(client)
        assert set(listed) == {"base", "alpha"}
        alpha = listed["alpha"]
        assert alpha["root"] == adapters["alpha"] and alpha["parent"] == "base"
        assert alpha["object"] == "model" and alpha["owned_by"] == "pagoda"
        assert alpha["state"] == "ready" and alpha["max_model_len"] == listed["base"]["max_model_len"]
        assert listed["base"]["parent"] is None


def test_every_route_naming_an_adapter_runs_the_base_engine_with_it(adapters):
    with make_client(adapters) as client:
        engine = engine_of(client)
        response = complete(client, "alpha")
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "alpha"
        lora = engine.added[-1].lora_request
        assert isinstance(lora, LoRARequest)
        assert (lora.lora_name, lora.lora_path, lora.base_model_name) == (
            "alpha", adapters["alpha"], "base")
        assert complete(client, "base").json()["model"] == "base"
        assert engine.added[-1].lora_request is None
        assert complete(client, None).json()["model"] == "base"
        assert engine.added[-1].lora_request is None

        chat = client.post("/v1/chat/completions", headers=AUTH, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "alpha" and engine.added[-1].lora_request == lora
        stream = client.post("/v1/chat/completions", headers=AUTH, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "stream": True})
        assert stream.status_code == 200 and '"model":"alpha"' in stream.text.replace(" ", "")
        assert engine.added[-1].lora_request == lora
        responses = client.post("/v1/responses", headers=AUTH, json={
            "model": "alpha", "input": "hi", "max_output_tokens": 2})
        assert responses.status_code == 200, responses.text
        assert responses.json()["model"] == "alpha" and engine.added[-1].lora_request == lora

        tokenized = client.post("/tokenize", json={"model": "alpha", "prompt": "hi"})
        assert tokenized.status_code == 200, tokenized.text
        assert client.post("/detokenize", json={"model": "alpha", "tokens": [104]}
                           ).status_code == 200
        unknown = complete(client, "nope")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        # The base's handlers serve each adapter's request as the adapter, and are
        # unchanged by it (nothing is copied or set per adapter).
        base = client.app.state.pagoda.registry.ready["base"]
        assert not hasattr(base.serving.completions, "lora_request")
        assert base.serving.completions.model_name == "base"
        assert complete(client, None).json()["model"] == "base"
        assert engine.added[-1].lora_request is None


def test_embeddings_carry_the_adapter(adapters):
    from pagoda.engine.core.input_processor import InputProcessor
    from pagoda.entrypoints.openai.protocol.embedding import EmbeddingRequest
    from pagoda.pooling_params import ModelPooling

    with make_client(adapters) as client:
        engine = engine_of(client)
        engine.input_processor = InputProcessor(engine.tokenizer, engine.vocab_size,
                                                engine.max_model_len,
                                                model_pooling=ModelPooling("last", True))
        state = client.app.state.pagoda
        served_as = state.loras.adapters["alpha"].served_as
        prompts = state.registry.ready["base"].serving.embeddings.validate(
            EmbeddingRequest(model="alpha", input=["hi", "ho"]), served_as)
        assert [p.lora_request.lora_name for p in prompts] == ["alpha", "alpha"]
        assert all(p.pooling is not None for p in prompts)


def test_load_serve_unload_and_load_again(adapters):
    with make_client(adapters) as client:
        engine = engine_of(client)
        response = load(client, "beta", adapters["beta"])
        assert response.status_code == 200, response.text
        assert response.text == "Success: LoRA adapter 'beta' added successfully."
        assert cards(client)["beta"]["parent"] == "base"
        complete(client, "beta")
        first_id = engine.added[-1].lora_request.lora_int_id
        alpha_id = client.app.state.pagoda.loras.adapters["alpha"].request.lora_int_id
        assert first_id != alpha_id

        response = unload(client, "beta")
        assert response.status_code == 200, response.text
        assert response.text == "Success: LoRA adapter 'beta' removed successfully."
        assert engine.removed_loras == [first_id]
        assert "beta" not in cards(client)
        gone = complete(client, "beta")
        assert gone.status_code == 404 and "beta" in gone.json()["error"]["message"]

        # The same name again (here from a link inside the allowed folder): a fresh id, so
        # the engine never mixes it with the unloaded one's weights or cached blocks.
        assert load(client, "beta", adapters["alpha"]).status_code == 200
        complete(client, "beta")
        assert engine.added[-1].lora_request.lora_int_id not in (first_id, alpha_id)

        # load_inplace replaces an adapter: new id, the old one freed
        old_id = engine.added[-1].lora_request.lora_int_id
        assert load(client, "beta", adapters["beta"], load_inplace=True).status_code == 200
        assert engine.removed_loras == [first_id, old_id]
        complete(client, "beta")
        assert engine.added[-1].lora_request.lora_int_id not in (first_id, old_id)


@pytest.mark.parametrize(("name", "path_key", "param", "fragments"), [
    ("x", "rank32", "lora_path", ["rank 32", "--max-lora-rank 16"]),
    ("x", "other_shape", "lora_path", ["gate_proj", "base model's is 64 -> 96"]),
    ("x", "embed", "lora_path", ["embed_tokens"]),
    ("x", "missing", "lora_path", ["LoRA adapter 'x'", "missing"]),
    ("x", "outside", "lora_path", ["outside the directories --lora-allowed-paths allows"]),
    ("x", "link_out", "lora_path", ["outside the directories --lora-allowed-paths allows"]),
    ("x", "dotdot", "lora_path", ["outside the directories --lora-allowed-paths allows"]),
    ("alpha", "beta", "lora_name", ["`alpha` is already loaded"]),
    ("base", "beta", "lora_name", ["`base` is the name of a served model"]),
])
def test_each_bad_load_is_a_400_naming_the_problem(adapters, name, path_key, param, fragments):
    with make_client(adapters) as client:
        response = load(client, name, adapters[path_key])
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        for fragment in fragments:
            assert fragment in error["message"], error["message"]
        assert set(cards(client)) == {"base", "alpha"}
        assert engine_of(client).removed_loras == []


def test_refusals_of_the_server_as_configured(adapters):
    with make_client(adapters, allowed=()) as client:
        response = load(client, "beta", adapters["beta"])
        assert response.status_code == 400
        assert "--lora-allowed-paths" in response.json()["error"]["message"]
    with make_client(adapters, lora=None, modules=()) as client:
        response = load(client, "beta", adapters["beta"])
        assert response.status_code == 400
        assert "--enable-lora" in response.json()["error"]["message"]
        assert complete(client, "alpha").status_code == 404  # (lora off: an unknown model)
    with make_client(adapters) as client:
        response = unload(client, "nope")
        assert response.status_code == 400 and "`nope` is not loaded" in response.text
        response = unload(client, "alpha", lora_int_id=999)
        assert response.status_code == 400 and response.json()["error"]["param"] == "lora_int_id"
        extra = client.post("/v1/load_lora_adapter", headers=AUTH,
                            json={"lora_name": "b", "lora_path": adapters["beta"], "x": 1})
        assert extra.status_code == 400
        # behind the API key, as model loading
        assert client.post("/v1/load_lora_adapter", json={
            "lora_name": "b", "lora_path": adapters["beta"]}).status_code == 401
        assert client.post("/v1/unload_lora_adapter", json={
            "lora_name": "alpha"}).status_code == 401
        # a model may not take an adapter's name either
        model = client.post("/v1/models/load", headers=AUTH,
                            json={"model": "alpha", "path": "/m2"})
        assert model.status_code == 400 and "LoRA adapter" in model.text
    with make_client(adapters, api_key=None) as client:
        for response in (load(client, "beta", adapters["beta"]), unload(client, "alpha")):
            assert response.status_code == 403
            assert "--api-key" in response.json()["error"]["message"]


def test_start_up_adapters_are_checked(adapters):
    with pytest.raises(ValueError, match="--lora-modules bad: .*rank 32"):
        make_client(adapters, modules=(LoRAModule("bad", adapters["rank32"]),))
    with pytest.raises(ValueError, match="--enable-lora"):
        make_client(adapters, lora=LoRAConfig())


def test_an_adapter_routes_only_while_its_base_is_served(adapters):
    other = LoRAEngine("/other")
    more = [ServedModel("other", other, "/other", lora=LORA,
                        hf_config=LlamaConfig(**COMMON))]
    modules = (LoRAModule("alpha", adapters["alpha"]),
               LoRAModule("on_other", adapters["beta"], "other"))
    with make_client(adapters, modules=modules, more_models=more) as client:
        assert cards(client)["on_other"]["parent"] == "other"
        assert complete(client, "on_other").status_code == 200
        assert other.added[-1].lora_request.lora_name == "on_other"
        assert not any(r.lora_request for r in engine_of(client).added)
        # the web page's live view of an adapter is its base engine's
        state = client.app.state.pagoda
        engines = served_engines(state.registry, state.loras)
        assert engines["on_other"] is other and engines["alpha"] is state.default_model.engine
        assert client.post("/v1/models/unload", headers=AUTH,
                           json={"model": "other"}).status_code == 200
        assert "on_other" not in cards(client)
        response = complete(client, "on_other")
        assert response.status_code == 404 and "on_other" in response.json()["error"]["message"]
