"""What packed weights multiply in (kernels/arithmetic.py): large batches (prefill chunks)
in float32 or bfloat16, small ones (decode steps) with float32, 16- or 8-bit activations. The
choice (a measurement where it is `auto`, never a CPU name), the runner setting it on every
packed linear but the logits head, and a prefill taking the bf16 path. The products
themselves: test_gguf_packed.py; the whole-stack step's int8: test_decode_kernel.py; their
fidelity: test_fidelity.py. AMX tiles for several rows: chosen per format by measurement
here, their products in test_gguf_packed.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from pagoda.config import CacheConfig, EngineConfig, ModelConfig
from pagoda.executor.kernels import arithmetic, build, ops
from pagoda.executor.kernels.packed_weight import from_group_quantized
from pagoda.executor.kernels.packing import quantize_groups
from pagoda.executor.layers.packed_linear import PackedLinear, set_arithmetic
from pagoda.executor.runner_builder import build_runner


def test_explicit_choices_and_dtypes_need_no_measurement(monkeypatch) -> None:
    monkeypatch.setattr(arithmetic, "bf16_speedup", lambda: pytest.fail("measured"))
    monkeypatch.setattr(arithmetic, "int16_speedup", lambda weights: pytest.fail("measured"))
    prefill = arithmetic.resolve_prefill_dtype
    decode = lambda setting, dtype: arithmetic.resolve_decode_activations(setting, dtype, [])
    assert prefill("float32", "auto") == torch.float32
    assert prefill("bfloat16", "float32") == torch.bfloat16
    assert prefill("auto", "float32") == torch.float32  # an explicit float32 run stays float32
    assert prefill("auto", "bfloat16") == torch.bfloat16
    assert decode("int8", "float32") == 1 and decode("int16", "float32") == 2
    assert decode("float32", "auto") == decode("auto", "float32") == 0
    assert decode("auto", "bfloat16") == 0
    with pytest.raises(ValueError, match="prefill_dtype must be"):
        prefill("float16", "auto")
    with pytest.raises(ValueError, match="decode_activations must be"):
        decode("int4", "auto")


@pytest.mark.parametrize("speedup, chosen", [(1.0, torch.float32), (1.49, torch.float32),
                                             (1.5, torch.bfloat16), (5.0, torch.bfloat16)])
def test_auto_takes_bf16_only_where_it_measures_clearly_faster(monkeypatch, speedup,
                                                                chosen) -> None:
    monkeypatch.setattr(arithmetic, "bf16_speedup", lambda: speedup)
    assert arithmetic.resolve_prefill_dtype("auto", "auto") == chosen


@pytest.mark.parametrize("speedup, parts", [(0.6, 0), (1.09, 0), (1.1, 2), (2.0, 2)])
def test_auto_takes_int16_only_where_it_measures_clearly_faster(monkeypatch, speedup,
                                                                 parts) -> None:
    """(never int8: llama.cpp's coarser arithmetic is asked for by name)"""
    monkeypatch.setattr(arithmetic, "int16_speedup", lambda weights: speedup)
    assert arithmetic.resolve_decode_activations("auto", "auto", []) == parts


def test_the_measurements_time_both_products() -> None:
    """Real (small) timings: finite positive ratios. Their values are this CPU's."""
    weight = from_group_quantized(quantize_groups(torch.randn(32, 256), "q4"))
    for speedup in (arithmetic.bf16_speedup((16, 64, 32), repeats=1),
                    arithmetic.int16_speedup([weight], repeats=1)):
        assert math.isfinite(speedup) and speedup > 0


class FakeKernels:
    """The two AMX entries of the kernel library, recorded."""

    def __init__(self, available: int) -> None:
        self.available, self.min_rows = available, {}

    def pagoda_amx_available(self) -> int:
        return self.available

    def pagoda_set_amx_min_rows(self, format: int, rows: int) -> None:
        self.min_rows[format] = rows


class FakeWeight:
    def __init__(self, format: str, nbytes: int = 1 << 20) -> None:
        self.format, self.size = format, nbytes

    def nbytes(self) -> int:
        return self.size


def test_amx_tiles_take_a_format_from_the_fewest_rows_that_measure_faster(monkeypatch) -> None:
    """Per format, the row counts are timed largest first; the tiles take the format from
    the last one still >= MIN_AMX_SPEEDUP, or never; Q8 (float32 activations always) is not
    timed; each format's sample stops at AMX_SAMPLE_BYTES."""
    lib = FakeKernels(available=1)
    monkeypatch.setattr(build, "load_cpu_kernels", lambda: lib)
    speedups = {"q4k": {16: 1.4, 12: 1.1, 8: 0.9}, "q6k": {16: 1.05, 12: 2.0, 8: 2.0},
                "q4": {16: 1.5, 12: 1.5, 8: 1.5}}
    timed = []

    def amx_speedup(sample, rows, parts):
        assert parts == 2 and len({w.format for w in sample}) == 1
        timed.append((sample[0].format, rows, len(sample)))
        return speedups[sample[0].format][rows]

    monkeypatch.setattr(arithmetic, "amx_speedup", amx_speedup)
    big = arithmetic.AMX_SAMPLE_BYTES // 2
    weights = [FakeWeight("q4k", big) for _ in range(5)] + [FakeWeight("q6k"), FakeWeight("q8"),
                                                            FakeWeight("q4")]
    assert arithmetic.resolve_amx_rows(weights, 2) == {"q4k": 12, "q4": 8}
    assert ("q4k", 16, 2) in timed and not any(format == "q8" for format, _, _ in timed)
    assert [rows for format, rows, _ in timed if format == "q6k"] == [16]
    arithmetic.set_amx_rows({"q4k": 12, "q4": 8})
    assert lib.min_rows == {0: 8, 1: 0, 2: 0, 3: 12, 4: 0, 5: 0}  # FORMAT_* codes


@pytest.mark.parametrize("available, parts", [(0, 2), (2, 2), (1, 0)])
def test_amx_tiles_need_the_cpus_own_and_integer_activations(monkeypatch, available,
                                                             parts) -> None:
    """Without AMX, on the emulation build (tests force it), or under float32 activations:
    nothing is timed and no format takes the tiles."""
    monkeypatch.setattr(build, "load_cpu_kernels", lambda: FakeKernels(available))
    monkeypatch.setattr(arithmetic, "amx_speedup", lambda *args: pytest.fail("measured"))
    assert arithmetic.resolve_amx_rows([FakeWeight("q4k")], parts) == {}


@pytest.mark.slow
def test_the_amx_measurement_times_both_kernels(tmp_path_factory, monkeypatch) -> None:
    """A real (small) timing on the emulation build: a finite positive ratio."""
    from tests.executor.test_cpu_kernels import isa_library

    lib = isa_library("amx-emulated", tmp_path_factory)
    monkeypatch.setattr(build, "load_cpu_kernels", lambda: lib)
    monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    weight = from_group_quantized(quantize_groups(torch.randn(32, 256), "q4"))
    speedup = arithmetic.amx_speedup([weight], rows=16, parts=2, repeats=1)
    assert math.isfinite(speedup) and speedup > 0


def test_config_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="prefill_dtype must be one of"):
        ModelConfig(prefill_dtype="int8")
    with pytest.raises(ValueError, match="decode_activations must be one of"):
        ModelConfig(decode_activations="bfloat16")
    for decode_activations in ("int8", "int16"):
        with pytest.raises(ValueError, match="deterministic runs float32"):
            ModelConfig(deterministic=True, decode_activations=decode_activations)
    with pytest.raises(ValueError, match="deterministic runs float32"):
        ModelConfig(deterministic=True, prefill_dtype="bfloat16")



@pytest.fixture(scope="module")
def bf16_prefill_runner():
    config = EngineConfig(model=ModelConfig(prefill_dtype="bfloat16", decode_activations="int8",
                                            max_model_len=512),
                          cache=CacheConfig(kv_cache_memory=32 << 20))
    return build_runner(config)[0]


def test_the_runner_sets_its_choice_on_every_packed_linear_but_the_head(bf16_prefill_runner) -> None:
    model = bf16_prefill_runner.model
    head = model.quantized_head
    linears = [m for m in model.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(m.large_batch_dtype == torch.bfloat16 and m.activation_parts == 1
               for m in linears)
    assert isinstance(head, PackedLinear) and head.large_batch_dtype == torch.float32
    assert head.activation_parts == 0  # 8-bit: the head stays float32
    set_arithmetic(model, torch.bfloat16, 2)
    assert head.activation_parts == 2 and head.large_batch_dtype == torch.float32
    set_arithmetic(model, torch.bfloat16, 1)


def test_a_long_prefill_multiplies_in_bf16(bf16_prefill_runner, monkeypatch) -> None:
    """A 200-token prompt's logits at every position: every packed linear of the stack takes
    the bf16 large-batch path, the head float32's, and the logits stay close to float32's."""
    seen = []
    dequantized_matmul = ops.dequantized_matmul
    monkeypatch.setattr(ops, "dequantized_matmul", lambda x, n, f, dtype=torch.float32: (
        seen.append(dtype), dequantized_matmul(x, n, f, dtype))[1])
    prompt = list(range(100, 300))
    logits = bf16_prefill_runner.prompt_logits([prompt])[0]
    layers = bf16_prefill_runner.model.config.num_hidden_layers
    assert seen.count(torch.bfloat16) == 4 * layers and seen.count(torch.float32) == 1
    monkeypatch.setattr(ops, "dequantized_matmul", dequantized_matmul)
    for linear in bf16_prefill_runner.model.modules():
        if isinstance(linear, PackedLinear):
            monkeypatch.setattr(linear, "large_batch_dtype", torch.float32)
    reference = bf16_prefill_runner.prompt_logits([prompt])[0]
    assert not torch.equal(logits, reference)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1),
                                    log_target=True, reduction="batchmean")
    assert kl < 0.01


def test_the_start_line_names_the_prefill_dtype(caplog) -> None:
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=256),
                          cache=CacheConfig(kv_cache_memory=32 << 20))
    with caplog.at_level(logging.INFO, logger="pagoda.executor.runner_builder"):
        build_runner(config)
    assert "prefill matmuls in float32, decode activations float32" in caplog.text


def test_a_mixture_of_experts_is_timed_on_the_experts_a_token_reads(tmp_path,
                                                                    monkeypatch) -> None:
    """A MoE model's int16-against-float32 timing runs one token's weights: the dense ones
    and top_k experts a block, not all of them (which would time a read of the whole file,
    memory-bound either way)."""
    from tests.executor.tiny_checkpoints import build_checkpoint

    build_checkpoint("qwen3-moe", str(tmp_path), hidden_size=256, moe_intermediate_size=256,
                     intermediate_size=256)
    timed = []
    monkeypatch.setattr(arithmetic, "int16_speedup",
                        lambda weights: timed.append(weights) or 1.0)
    runner = build_runner(EngineConfig(
        model=ModelConfig(model=str(tmp_path), quantization="int8", decode_activations="auto"),
        cache=CacheConfig(kv_cache_memory=1 << 21)))[0]
    layers = runner.model.model.layers
    blocks = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    assert [(len(block.experts), block.top_k) for block in blocks] == [(4, 2), (4, 2)]
    read = {id(p) for block in blocks for expert in list(block.experts)[:2]
            for p in expert.modules()}
    unread = {id(m) for block in blocks for expert in list(block.experts)[2:]
              for m in expert.modules()}
    (weights,) = timed
    segments = {id(s): m for m in runner.model.modules() if isinstance(m, PackedLinear)
                for s in m.segments}
    owners = {id(segments[id(w)]) for w in weights}
    assert not owners & unread and owners >= {
        id(m) for m in runner.model.modules() if isinstance(m, PackedLinear) and id(m) in read}
    assert any(id(m) in owners for m in layers[1].mlp.modules())  # the dense layer's MLP
