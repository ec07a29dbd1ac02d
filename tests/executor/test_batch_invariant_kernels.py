"""The kernels behind --deterministic (executor/batch_invariant.py): each computes a row the
same way whatever else the call holds, checked bit for bit against one-row calls, and still
computes the right product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.executor.kernels import ops
from pagoda.executor.kernels.packed_weight import gemm_packed
from pagoda.executor.kernels.packing import quantize_and_pack
from pagoda.executor.layers.linear import linear_rows
from tests.executor.test_gguf_packed import TYPES, assert_matmul_close, case

ROW_COUNTS = (1, 2, 3, 4, 5, 9, ops.DEQUANTIZE_FROM_ROWS + 3)
"""Every tile-sharing case of the default kernel (1-4 rows a tile, remainders) and a count
past its dequantize-and-BLAS threshold."""


def one_row_at_a_time(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_rowwise_packed_matmul_gives_each_row_its_one_row_result(ggml_type) -> None:
    _, packed, reference = case(ggml_type, seed=3)
    x = torch.randn(max(ROW_COUNTS), reference.shape[1], generator=torch.Generator().manual_seed(3))
    alone = one_row_at_a_time(lambda row: gemm_packed(row, packed), x)
    for rows in ROW_COUNTS:
        y = gemm_packed(x[:rows], packed, rowwise=True)
        assert torch.equal(y, alone[:rows])
    assert_matmul_close(alone, x, reference)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_the_rowwise_quantized_matmul_gives_each_row_its_one_row_result(fmt) -> None:
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    codes, scales, mins = quantize_and_pack(weight, fmt)
    x = torch.randn(max(ROW_COUNTS), 256, generator=torch.Generator().manual_seed(5))
    gemm = lambda rows, **kw: ops.gemm_q(rows, codes, scales, mins, fmt, 64, **kw)
    alone = one_row_at_a_time(gemm, x)
    for rows in ROW_COUNTS:
        assert torch.equal(gemm(x[:rows], rowwise=True), alone[:rows])
    with pytest.raises(ValueError, match="float32"):
        gemm(x[:2].bfloat16(), rowwise=True)


def test_linear_rows_gives_each_row_its_one_row_result() -> None:
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(3, 70, 64)  # any leading shape
    y = linear_rows(x, weight, bias)
    assert y.shape == (3, 70, 96)
    flat = x.reshape(-1, 64)
    assert torch.equal(y.reshape(-1, 96), one_row_at_a_time(lambda r: F.linear(r, weight, bias), flat))
    torch.testing.assert_close(y, F.linear(x, weight, bias))


def test_the_silu_kernel_is_silu_times_up_and_row_invariant() -> None:
    gate_up = torch.randn(37, 2 * 100) * 4  # a width with a tail past the vector loop
    y = ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.equal(y, one_row_at_a_time(ops.silu_and_mul, gate_up))
