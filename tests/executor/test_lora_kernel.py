"""Per-row LoRA in C (csrc/lora_f32.c, the whole-stack decode step's adapters): y_i += B
(A x_i) for the adapter in row i's slot, each part of a fused linear at its own outputs and
ranks, on every instruction-set build (and the emulation builds any CPU runs), equal to the
same sums in torch to float32 rounding, for adapters stored in float32, bfloat16 and
float16 (widened to float32 as C loads them); rows without an adapter and empty slots
unchanged."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pagoda.executor.kernels.abi import LoRASlot
from pagoda.executor.lora.whole_stack_tables import fill_slot
from tests.executor.test_cpu_kernels import isa_build, isa_library  # noqa: F401 (a fixture)


class Part:
    def __init__(self, out_offset, out_size, rank_offset, rank, b_t):
        self.out_offset, self.out_size = out_offset, out_size
        self.rank_offset, self.rank, self.b_t = rank_offset, rank, b_t


class Fused:
    """A FusedLoRA's shape (executor/lora/fused.py): A stacked, parts' b_t (rank, out_size),
    stored in `dtype`."""

    def __init__(self, in_features, parts, seed, dtype=torch.float32):
        generator = torch.Generator().manual_seed(seed)
        ranks = [rank for _, _, rank in parts]
        self.a = (torch.randn(sum(ranks), in_features, generator=generator) * 0.1).to(dtype)
        self.parts, offset = [], 0
        for out_offset, out_size, rank in parts:
            b = torch.randn(out_size, rank, generator=generator) * 0.1
            self.parts.append(Part(out_offset, out_size, offset, rank,
                                   b.T.contiguous().to(dtype)))
            offset += rank

    def delta(self, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """The same sums in torch, float32 (the stored numbers widened exactly)."""
        out = torch.zeros(x.shape[0], out_features)
        shrunk = x @ self.a.float().T
        for p in self.parts:
            out[:, p.out_offset:p.out_offset + p.out_size] += \
                shrunk[:, p.rank_offset:p.rank_offset + p.rank] @ p.b_t.float()
        return out


class Linear:
    def __init__(self, in_features, out_features):
        self.in_features, self.out_features = in_features, out_features


def table_of(slots: list[Fused | None], linear: Linear):
    table = (LoRASlot * len(slots))()
    for entry, fused in zip(table, slots):
        if fused is not None:
            fill_slot(entry, fused, linear)  # points at fused's own tensors
    return table, slots


K, N = 96, 16 * 5 + 40  # a qkv-like linear: q 64, k 28, v 28 (off the 16-lane grid)


def adapters(k: int = K, dtypes=(torch.float32,) * 3) -> list[Fused | None]:
    """Three adapters (stored in `dtypes`, one each) in slots 0, 1, 3; slot 2 free."""
    return [
        Fused(k, [(0, 64, 8), (64, 28, 4), (92, 28, 16)], seed=1, dtype=dtypes[0]),  # q, k, v
        Fused(k, [(0, 64, 3), (92, 28, 5)], seed=2, dtype=dtypes[1]),  # q and v only
        None,  # a free slot
        Fused(k, [(64, 28, 1)], seed=3, dtype=dtypes[2]),  # k alone, rank 1
    ]


ADAPTERS = adapters()


def lora_add(lib, slots, row_slots, x, y):
    linear = Linear(x.shape[1], y.shape[1])
    table, _keep = table_of(slots, linear)
    row_slots = np.ascontiguousarray(row_slots, dtype=np.int32)
    lib.pagoda_lora_add_f32(ctypes.cast(table, ctypes.POINTER(LoRASlot)), len(slots),
                            row_slots.ctypes.data, x.data_ptr(), x.shape[0], x.shape[1],
                            y.data_ptr(), y.shape[1])


def reference(slots, row_slots, x, y):
    expected = y.clone()
    for t, s in enumerate(row_slots):
        if s >= 0 and slots[s] is not None:
            expected[t] += slots[s].delta(x[t:t + 1], y.shape[1])[0]
    return expected


@pytest.mark.slow  # (kernel builds for other CPUs)
@pytest.mark.parametrize("row_slots", [
    [0],  # one stream
    [0, -1, 1, 0, 3, 2, -1, 1, 3],  # mixed slots, base rows, a row on a free slot
    [0, 1, 0, 0, 3, 0, 1, 1, -1, 0, 1, 3, 3, 3, 0, 3],  # slots of 4+ rows (4-row blocks)
    [-1, -1, -1],  # no adapter rows: nothing changes
])
@pytest.mark.parametrize("k", [K, K + 4])  # inputs on and off the vectors' grid
@pytest.mark.parametrize("dtypes", [
    (torch.float32,) * 3, (torch.bfloat16,) * 3,
    (torch.float16, torch.bfloat16, torch.float32),  # each slot its own storage
], ids=["f32", "bf16", "mixed"])
def test_lora_rows_on_every_instruction_set_build(isa_build, row_slots,  # noqa: F811
                                                  k, dtypes) -> None:
    from pagoda.executor.kernels import ops

    lib = ops.load_cpu_kernels()
    slots = adapters(k, dtypes)
    torch.manual_seed(0)
    x, y = torch.randn(len(row_slots), k), torch.randn(len(row_slots), N)
    expected = reference(slots, row_slots, x, y)
    lora_add(lib, slots, row_slots, x, y)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for t, s in enumerate(row_slots):  # untouched rows are bit-equal
        if s < 0 or slots[s] is None:
            assert torch.equal(y[t], expected[t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_of_large_adapters_run_on_threads(tmp_path_factory, dtype) -> None:
    """Past LORA_PARALLEL_FLOATS weights a slot's shrink and expand are split over threads:
    the same sums."""
    lib = isa_library("native", tmp_path_factory)
    k, n = 512, 1024 + 48
    slots = [Fused(k, [(0, 1024, 16), (1024, 48, 16)], seed=4, dtype=dtype),
             Fused(k, [(0, 1072, 8)], seed=5, dtype=dtype)]
    row_slots = [0, 1] * 20 + [-1] * 3
    torch.manual_seed(1)
    x, y = torch.randn(len(row_slots), k), torch.randn(len(row_slots), n)
    expected = reference(slots, row_slots, x, y)
    lora_add(lib, slots, row_slots, x, y)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_width_weights_are_widened_exactly(dtype) -> None:
    """bf16 / f16 storage: C's sums are float32 sums of the stored numbers widened exactly,
    subnormal f16 numbers and signs included (rank 1, one input: one product a row)."""
    from pagoda.executor.kernels import ops

    lib = ops.load_cpu_kernels()
    values = torch.tensor([1.0, -2.5, 3e-6, -6e-8, 0.0, -0.0, 1024.0, 0.1] * 4).to(dtype)
    fused = Fused(1, [(0, 32, 1)], seed=1, dtype=dtype)
    fused.a = torch.ones(1, 1, dtype=dtype)
    fused.parts[0].b_t = values.reshape(1, 32).contiguous()
    y = torch.zeros(1, 32)
    lora_add(lib, [fused], [0], torch.ones(1, 1), y)
    assert torch.equal(y[0], values.float())


def test_an_adapter_that_does_not_fit_the_linear_is_refused() -> None:
    fused = Fused(K, [(0, 64, 8)], seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K + 32, N))
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K, 48))
    fused.a = fused.a.to(torch.float64)  # a dtype C does not read
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K, N))
    fused = Fused(K, [(0, 64, 8)], seed=1, dtype=torch.bfloat16)
    fused.parts[0].b_t = fused.parts[0].b_t.float()  # A and B^T in different dtypes
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K, N))
