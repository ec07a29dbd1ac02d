"""`bench latency`'s memory-bound figures (pagoda/bench/weight_traffic.py): the bytes a decode
step reads are the model's matrices and norms, the head included even where it is the tied
embedding, the lookup tables not; the report states them beside the measured bandwidth."""

from __future__ import annotations

import torch

from pagoda.bench import offline
from pagoda.bench.weight_traffic import decode_weight_bytes, read_bandwidth
from pagoda.executor.layers.packed_linear import PackedLinear
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from tests.executor.tiny_checkpoints import build_checkpoint


def float_model(folder: str, tie: bool) -> torch.nn.Module:
    build_checkpoint("llama", folder, tie_word_embeddings=tie)
    return load_model(open_checkpoint(resolve_model_files(folder)), torch.float32,
                      torch.device("cpu"), max_position=64)


def test_a_float_model_reads_its_matrices_norms_and_head(tmp_path) -> None:
    for tie in (False, True):
        model = float_model(str(tmp_path / str(tie)), tie)
        embedding = model.model.embed_tokens.weight
        per_layer = sum(p.numel() for p in model.model.layers.parameters())
        norms = model.model.norm.weight.numel()
        head = embedding.numel()  # untied: the lm_head's own matrix of the same shape
        assert decode_weight_bytes(model) == 4 * (per_layer + norms + head)


def test_a_mixture_of_experts_token_reads_its_chosen_experts(tmp_path) -> None:
    """Qwen3-MoE, 4 experts of which 2 a token (layer 1 dense): the experts count half."""
    build_checkpoint("qwen3-moe", str(tmp_path))
    model = load_model(open_checkpoint(resolve_model_files(str(tmp_path))), torch.float32,
                       torch.device("cpu"), max_position=64)
    experts = [block.experts for block in (layer.mlp for layer in model.model.layers)
               if hasattr(block, "experts")]
    assert [(len(e), block.top_k) for e, block in zip(
        experts, (layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")))
            ] == [(4, 2), (4, 2)]
    expert_bytes = sum(p.numel() * 4 for e in experts for p in e.parameters())
    everything = sum(p.numel() * 4 for p in model.parameters()) \
        - model.model.embed_tokens.weight.numel() * 4
    assert decode_weight_bytes(model) == everything - expert_bytes // 2


def test_a_packed_model_reads_its_packed_planes(bundled_llm) -> None:
    model = bundled_llm.engine.runner.model
    packed = {id(p): p for m in model.modules() if isinstance(m, PackedLinear)
              for segment in m.segments for p in segment.planes.values()}
    assert packed  # (the bundled Q4_1 / Q8_0 file runs packed)
    norms = sum(m.weight.numel() * 4 for name, m in model.named_modules() if name.endswith("norm"))
    assert decode_weight_bytes(model) == sum(p.nbytes for p in packed.values()) + norms


def test_latency_reports_the_share_of_the_read_bandwidth(bundled_llm) -> None:
    assert read_bandwidth(repeats=2) > 1e8  # any machine reads more than 100 MB/s
    traffic = offline.weight_traffic(bundled_llm, decode_tokens_per_s=50.0)
    assert traffic["weight_read_bytes_per_s"] == 50.0 * traffic["weight_bytes_per_token"]
    assert traffic["fraction_of_read_bandwidth"] == (
        traffic["weight_read_bytes_per_s"] / traffic["memory_read_bytes_per_s"])
    summary, _ = offline.run_latency(bundled_llm, 8, 3, 1, 0)
    summary["weight_traffic"] = traffic
    assert "GB/s" in offline.format_latency(summary, 8, 3).splitlines()[-1]
