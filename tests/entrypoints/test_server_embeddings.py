"""POST /v1/embeddings on a real `pagoda serve` over a tiny random Qwen3 that is set up as a
sentence-transformers embedding model (mean pooling, a Normalize module, Matryoshka sizes
16 and 32 in its config.json): the official openai client (its default base64 encoding and
floats), LangChain's OpenAIEmbeddings, every input shape, `dimensions`, each bad request a
400 naming its field, embeddings concurrent with generation (neither changes), nothing
held afterwards; the same vectors from two data-parallel replicas."""

from __future__ import annotations

import asyncio
import base64
import json
import os

import httpx
import numpy as np
import openai
import pytest

from pagoda import LLM, PoolingParams, SamplingParams
from tests.entrypoints.server_helpers import RemoteServer
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer

pytestmark = pytest.mark.slow

NAME = "tiny-embed"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]
TOKEN_IDS = [[5, 17, 99, 3, 42], [1000, 2000]]
ATOL = 1e-5
GENERATION_PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("embed"))
    build_checkpoint_with_bundled_tokenizer(folder, "qwen3")
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["matryoshka_dimensions"] = [16, 32]
    with open(config_path, "w") as f:
        json.dump(config, f)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}], f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
                   "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}, f)
    return folder


@pytest.fixture(scope="module")
def offline(model_folder) -> LLM:
    return LLM(model_folder, dtype="float32", max_model_len=2048,
               kv_cache_memory=64 * 1024 * 1024)


def offline_vectors(llm: LLM, prompts, **params) -> list[np.ndarray]:
    outputs = llm.embed(prompts, PoolingParams(**params), use_tqdm=False)
    return [np.array(o.outputs.embedding) for o in outputs]


@pytest.fixture(scope="module")
def server(model_folder):
    # A small token budget: prompts are chunked, and embeddings share steps with generation.
    with RemoteServer(["--model", model_folder, "--served-model-name", NAME,
                       "--max-num-batched-tokens", "8", "--no-access-log"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_base64_and_float(client, offline, server):
    expected = offline_vectors(offline, TEXTS)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in expected)  # the Normalize module
    response = client.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks for base64
    assert response.object == "list" and response.model == NAME
    assert [d.index for d in response.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in response.data)
    for data, vector in zip(response.data, expected):
        np.testing.assert_allclose(data.embedding, vector, atol=ATOL)
    num_tokens = sum(len(offline.get_tokenizer().encode(t)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    floats = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=ATOL)
    raw = httpx.post(server.url + "/v1/embeddings", timeout=60,
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (64,)
    np.testing.assert_allclose(decoded, expected[0], atol=ATOL)
    assert set(raw) == {"object", "data", "model", "usage"}
    assert set(raw["usage"]) == {"prompt_tokens", "total_tokens"}


def test_token_ids_and_dimensions(client, offline):
    expected = offline_vectors(offline, TOKEN_IDS)
    one = client.embeddings.create(model=NAME, input=TOKEN_IDS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=ATOL)
    assert one.usage.prompt_tokens == len(TOKEN_IDS[0])
    several = client.embeddings.create(model=NAME, input=TOKEN_IDS, user="someone")
    for data, vector in zip(several.data, expected):
        np.testing.assert_allclose(data.embedding, vector, atol=ATOL)
    cut = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16)
    full = offline_vectors(offline, TEXTS[:2], normalize=False)
    for data, whole in zip(cut.data, full):
        assert len(data.embedding) == 16
        np.testing.assert_allclose(data.embedding, whole[:16] / np.linalg.norm(whole[:16]),
                                   atol=ATOL)


def test_the_most_inputs_come_back_in_order(client, offline):
    inputs = [[i % 500 + 1] for i in range(2048)]  # OpenAI's bound: 2048 inputs
    response = client.embeddings.create(model=NAME, input=inputs, encoding_format="float")
    assert [d.index for d in response.data] == list(range(2048))
    expected = offline_vectors(offline, inputs[:3])
    for data, vector in zip(response.data[500:503], expected):  # ids 1, 2, 3 again
        np.testing.assert_allclose(data.embedding, vector, atol=ATOL)
    assert response.usage.prompt_tokens == 2048


BAD_REQUESTS = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [[1, 2], "a"]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [1, 10 ** 9]}, "input"),
    ({"input": [[1], [-1]]}, "input"),
    ({"input": "word " * 3000}, "input"),
    ({"input": [[1] * 3000]}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 20}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 128}, "dimensions"),
    ({"input": "x", "dimensions": "16"}, "dimensions"),
    ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "temperature": 0}, "temperature"),
    ({"input": "x", "user": 5}, "user"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS)
def test_bad_requests_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_an_unknown_model_is_404(server):
    response = httpx.post(server.url + "/v1/embeddings", timeout=60,
                          json={"input": "x", "model": "nope"})
    assert response.status_code == 404


def test_embeddings_beside_generation_change_neither(server, offline):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = offline.generate([GENERATION_PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    expected = offline_vectors(offline, TEXTS)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0) as aclient:
            generation = aclient.completions.create(
                model=NAME, prompt=GENERATION_PROMPT, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
            embeddings = [aclient.embeddings.create(model=NAME, input=TEXTS)
                          for _ in range(4)]
            return await asyncio.gather(generation, *embeddings)

    completion, *responses = asyncio.run(main())
    assert completion.choices[0].text == alone
    for response in responses:
        for data, vector in zip(response.data, expected):
            np.testing.assert_allclose(data.embedding, vector, atol=ATOL)
    assert server.metric("num_kv_blocks_held") == 0
    assert server.metric("num_requests_running") == 0
    assert server.metric("num_requests_tracked") == 0


def test_langchain_openai_embeddings(server, offline):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts themselves (the default tokenizes
    # them with tiktoken first, for OpenAI's own models)
    embeddings = OpenAIEmbeddings(model=NAME, base_url=server.url + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    expected = offline_vectors(offline, TEXTS)
    documents = embeddings.embed_documents(TEXTS)
    assert len(documents) == len(TEXTS) and all(len(v) == 64 for v in documents)
    for vector, reference in zip(documents, expected):
        np.testing.assert_allclose(vector, reference, atol=ATOL)
    np.testing.assert_allclose(embeddings.embed_query(TEXTS[1]), expected[1], atol=ATOL)


def test_data_parallel_replicas_give_the_same_vectors(model_folder, offline):
    expected = offline_vectors(offline, TEXTS)
    with RemoteServer(["--model", model_folder, "--served-model-name", NAME,
                       "--data-parallel-size", "2", "--no-access-log"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # (each input goes to whichever replica the router picks)
            response = client.embeddings.create(model=NAME, input=TEXTS)
            for data, vector in zip(response.data, expected):
                np.testing.assert_allclose(data.embedding, vector, atol=ATOL)
        cut = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=32)
        assert len(cut.data[0].embedding) == 32
        bad = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "dimensions": 20},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
