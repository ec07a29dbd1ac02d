"""Embeddings through the real engine on tiny random Qwen3 and Llama checkpoints (float32):
each pooling (last, mean, CLS) equals transformers' last_hidden_state pooled the same way and
L2-normalised, with every prompt chunked over several steps (an 8-token budget) and batched
with a generation request, whose greedy tokens do not change; the KV blocks are free once
the vectors are back; prefix-cache hits serve last-token pooling and are refused for mean and
CLS; `dimensions` cuts then renormalises; the model's sentence-transformers files and GGUF
metadata choose the pooling, --pooling overrides them."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams
from pagoda.config import EmbeddingConfig
from pagoda.executor.loader.model_files import ModelFiles, ModelLoadError
from pagoda.executor.loader.pooling_files import model_pooling
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer

PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 1000, 31, 2, 64, 12, 250], [7],
           list(range(300, 330)), [40, 41, 42, 43, 44, 45, 46, 47]]
POOLINGS = ("last", "mean", "cls")
ENGINE = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64,
          "max_num_batched_tokens": 8, "block_size": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ATOL = 2e-5


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    """(transformers model, LLM) of one tiny random architecture."""
    folder = str(tmp_path_factory.mktemp(request.param))
    build_checkpoint_with_bundled_tokenizer(folder, request.param)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return reference, LLM(folder, matryoshka=True, **ENGINE)


def reference_vector(model, prompt: list[int], pooling: str, normalize: bool = True):
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # (len, hidden)
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def embed(llm: LLM, prompts, **params) -> list[torch.Tensor]:
    outputs = llm.embed(prompts, PoolingParams(**params), use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    snapshot = llm.engine.snapshot()
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_each_pooling_equals_transformers_with_chunked_prefill(tiny, pooling):
    reference, llm = tiny
    vectors = embed(llm, PROMPTS, pooling=pooling)
    for prompt, ours in zip(PROMPTS, vectors):
        theirs = reference_vector(reference, prompt, pooling)
        assert ours.shape == (reference.config.hidden_size,)
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        assert abs(ours.norm().item() - 1) < 1e-5
    raw = embed(llm, PROMPTS[:1], pooling=pooling, normalize=False)[0]
    torch.testing.assert_close(raw, reference_vector(reference, PROMPTS[0], pooling, False),
                               atol=ATOL * 10, rtol=1e-5)
    assert_all_blocks_free(llm)


def test_batched_with_generation_changes_neither(tiny):
    _, llm = tiny
    engine = llm.engine
    alone_tokens = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    alone = {p: embed(llm, PROMPTS, pooling=p) for p in POOLINGS}
    engine.reset_prefix_cache()  # nothing served from the cache: every step really computes
    engine.add_request("gen", PROMPTS[2], GREEDY)
    for pooling in POOLINGS:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{pooling}-{i}", prompt, PoolingParams(pooling=pooling))
    outputs, shared_steps = {}, 0
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        snapshot = engine.snapshot()
        running = set(snapshot.running_request_ids)
        shared_steps += "gen" in running and len(running) > 1
        outputs.update({o.request_id: o for o in step_outputs if o.finished})
    assert shared_steps > 0, "the embeddings ran in steps of their own"
    assert outputs["gen"].outputs[0].token_ids == alone_tokens
    assert outputs["gen"].embedding is None
    for pooling in POOLINGS:
        for i in range(len(PROMPTS)):
            output = outputs[f"{pooling}-{i}"]
            assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids == []
            torch.testing.assert_close(torch.tensor(output.embedding), alone[pooling][i],
                                       atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(("pooling", "cached"), [("last", True), ("mean", False),
                                                 ("cls", False)])
def test_prefix_cache_serves_last_token_pooling_only(tiny, pooling, cached):
    _, llm = tiny
    prompt = list(range(500, 530))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # caches its blocks
    [output] = llm.embed([prompt], PoolingParams(pooling=pooling), use_tqdm=False)
    assert llm.engine.reset_prefix_cache()  # (True: no block in use)
    [uncached] = embed(llm, [prompt], pooling=pooling)
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), uncached, atol=ATOL,
                               rtol=0)
    counts = []
    for _ in range(2):
        llm.engine.add_request(f"c-{pooling}-{len(counts)}", prompt,
                               PoolingParams(pooling=pooling))
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                counts.append(out.num_cached_tokens)
    assert (counts[-1] > 0) == cached  # the second one found the first one's blocks
    assert_all_blocks_free(llm)


def test_dimensions_cut_then_renormalise(tiny):
    _, llm = tiny
    full = embed(llm, PROMPTS[:2], normalize=False)
    cut = embed(llm, PROMPTS[:2], dimensions=16)
    for whole, part in zip(full, cut):
        assert part.shape == (16,)
        torch.testing.assert_close(part, torch.nn.functional.normalize(whole[:16], dim=-1),
                                   atol=ATOL, rtol=0)


def test_model_files_choose_the_pooling(tmp_path):
    hf_config = SimpleNamespace(hidden_size=64)
    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    files = ModelFiles(str(folder), "hf")

    def write(modes: dict, normalize: bool) -> None:
        modules = [{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, **modes}))

    default = EmbeddingConfig()
    assert model_pooling(default, files, hf_config).pooling == "last"  # no modules.json
    for key, pooling in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                         ("pooling_mode_cls_token", "cls")):
        write({key: True}, normalize=False)
        chosen = model_pooling(default, files, hf_config)
        assert (chosen.pooling, chosen.normalize) == (pooling, False)
        assert chosen.source == os.path.join("1_Pooling", "config.json")
    write({"pooling_mode_mean_tokens": True}, normalize=True)
    assert model_pooling(default, files, hf_config).normalize is True
    flags = EmbeddingConfig(pooling="cls", normalize_embeddings=False)
    chosen = model_pooling(flags, files, hf_config)
    assert (chosen.pooling, chosen.normalize, chosen.source) == ("cls", False, "--pooling")
    write({"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens.*--pooling"):
        model_pooling(default, files, hf_config)
    assert model_pooling(EmbeddingConfig(pooling="mean"), files, hf_config).pooling == "mean"
    # GGUF: llama.cpp's <arch>.pooling_type (0 none, 1 mean, 2 cls, 3 last).
    gguf = ModelFiles(str(tmp_path / "m.gguf"), "gguf")
    for value, pooling in ((1, "mean"), (2, "cls"), (3, "last"), (0, "last"), (None, "last")):
        assert model_pooling(default, gguf, hf_config, ("qwen3", value)).pooling == pooling
    # Matryoshka: the config's list, its flag, or --matryoshka.
    assert not model_pooling(default, gguf, hf_config).matryoshka
    listed = model_pooling(default, gguf, SimpleNamespace(hidden_size=64,
                                                          matryoshka_dimensions=[16, 32]))
    assert listed.matryoshka and listed.matryoshka_dimensions == (16, 32)
    assert model_pooling(default, gguf, SimpleNamespace(hidden_size=64,
                                                        is_matryoshka=True)).matryoshka
    assert model_pooling(EmbeddingConfig(matryoshka=True), gguf, hf_config).matryoshka


def test_a_gguf_file_gives_its_pooling_type(tmp_path, monkeypatch):
    import gguf

    from pagoda.executor.loader import gguf_writer
    from pagoda.executor.loader.gguf_loader import GGUFCheckpoint
    from tests.executor.tiny_checkpoints import build_checkpoint

    build_checkpoint("qwen3", str(tmp_path))
    write_metadata = gguf_writer.write_hf_metadata

    def with_pooling(writer, cfg) -> None:
        write_metadata(writer, cfg)
        writer.add_pooling_type(gguf.PoolingType.CLS)

    monkeypatch.setattr(gguf_writer, "write_hf_metadata", with_pooling)
    path = str(tmp_path / "tiny.gguf")
    gguf_writer.write_hf_checkpoint(str(tmp_path), path)
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.pooling_type == 2
    chosen = model_pooling(EmbeddingConfig(), ModelFiles(path, "gguf"), checkpoint.hf_config,
                           (checkpoint.architecture, checkpoint.pooling_type))
    assert (chosen.pooling, chosen.source) == ("cls", "GGUF qwen3.pooling_type")


def test_llm_pooling_keyword_sets_the_default(tmp_path):
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "qwen3")
    llm = LLM(folder, pooling="mean", normalize_embeddings=False, **ENGINE)
    [ours] = embed(llm, [PROMPTS[0]])
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(ours, reference_vector(reference, PROMPTS[0], "mean", False),
                               atol=ATOL * 10, rtol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=8), use_tqdm=False)


@pytest.mark.slow
def test_tensor_parallel_gives_the_same_vectors(tiny):
    """TP=2 (two worker processes): rank 0's pooled vectors equal TP=1's within float32
    rounding of the split sums."""
    _, llm = tiny
    folder = llm.engine.model_files.path
    tp2 = LLM(folder, tensor_parallel_size=2, **ENGINE)
    try:
        for pooling in POOLINGS:
            for ours, theirs in zip(embed(tp2, PROMPTS, pooling=pooling),
                                    embed(llm, PROMPTS, pooling=pooling)):
                torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert_all_blocks_free(tp2)
    finally:
        tp2.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_bare_decoder_stack_loads_and_embeds(arch, tmp_path):
    """An embedding model saved as `Qwen3Model` / `LlamaModel` (names without `model.`, no
    lm_head, as e5-mistral and Qwen3-Embedding are published) loads, and embeds as
    transformers' stack computes."""
    from transformers import AutoModel

    from tests.executor.tiny_checkpoints import bundled_tokenizer

    with_head = tmp_path / "with-head"
    build_checkpoint_with_bundled_tokenizer(str(with_head), arch)
    stack = AutoModel.from_pretrained(with_head, dtype=torch.float32).eval()  # the bare stack
    bare = tmp_path / "bare"
    stack.save_pretrained(bare, safe_serialization=True)
    bundled_tokenizer().save_pretrained(bare)
    config = json.loads((bare / "config.json").read_text())
    assert config["architectures"][0].endswith("Model")
    llm = LLM(str(bare), **ENGINE)
    for pooling in POOLINGS:
        [ours] = embed(llm, [PROMPTS[0]], pooling=pooling)
        with torch.no_grad():
            hidden = stack(torch.tensor([PROMPTS[0]])).last_hidden_state[0]
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        torch.testing.assert_close(ours, torch.nn.functional.normalize(vector, dim=-1),
                                   atol=ATOL, rtol=0)
