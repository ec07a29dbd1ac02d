"""Per-row LoRA in C (csrc/lora_f32.c, the whole-stack decode step's adapters): y_i += B
(A x_i) for the adapter in row i's slot, each part of a fused linear at its own outputs and
ranks, on every instruction-set build (and the emulation builds any CPU runs), equal to the
same sums in torch to float32 rounding; rows without an adapter and empty slots unchanged."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pagoda.executor.kernels.abi import LoRASlot
from pagoda.executor.whole_stack_lora import fill_slot
from tests.executor.test_cpu_kernels import isa_build, isa_library  # noqa: F401 (a fixture)


class Part:
    def __init__(self, out_offset, out_size, rank_offset, rank, b):
        self.out_offset, self.out_size = out_offset, out_size
        self.rank_offset, self.rank, self.b = rank_offset, rank, b


class Fused:
    """A FusedLoRA's shape (executor/lora/fused.py): A stacked, parts' B (out_size, rank)."""

    def __init__(self, in_features, parts, seed):
        generator = torch.Generator().manual_seed(seed)
        ranks = [rank for _, _, rank in parts]
        self.a = torch.randn(sum(ranks), in_features, generator=generator) * 0.1
        self.parts, offset = [], 0
        for out_offset, out_size, rank in parts:
            b = torch.randn(out_size, rank, generator=generator) * 0.1
            self.parts.append(Part(out_offset, out_size, offset, rank, b))
            offset += rank

    def delta(self, x: torch.Tensor, out_features: int) -> torch.Tensor:
        out = torch.zeros(x.shape[0], out_features)
        shrunk = x @ self.a.T
        for p in self.parts:
            out[:, p.out_offset:p.out_offset + p.out_size] += \
                shrunk[:, p.rank_offset:p.rank_offset + p.rank] @ p.b.T
        return out


class Linear:
    def __init__(self, in_features, out_features):
        self.in_features, self.out_features = in_features, out_features


def table_of(slots: list[Fused | None], linear: Linear):
    table = (LoRASlot * len(slots))()
    keep = []
    for entry, fused in zip(table, slots):
        if fused is not None:
            b_ts = [p.b.T.contiguous() for p in fused.parts]
            keep.append(b_ts)
            fill_slot(entry, fused, b_ts, linear)
    return table, keep


K, N = 96, 16 * 5 + 40  # a qkv-like linear: q 64, k 28, v 28 (off the 16-lane grid)


def adapters(k: int = K) -> list[Fused | None]:
    return [
        Fused(k, [(0, 64, 8), (64, 28, 4), (92, 28, 16)], seed=1),  # q, k, v
        Fused(k, [(0, 64, 3), (92, 28, 5)], seed=2),  # q and v only
        None,  # a free slot
        Fused(k, [(64, 28, 1)], seed=3),  # k alone, rank 1
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


@pytest.mark.parametrize("row_slots", [
    [0],  # one stream
    [0, -1, 1, 0, 3, 2, -1, 1, 3],  # mixed slots, base rows, a row on a free slot
    [0, 1, 0, 0, 3, 0, 1, 1, -1, 0, 1, 3, 3, 3, 0, 3],  # slots of 4+ rows (4-row blocks)
    [-1, -1, -1],  # no adapter rows: nothing changes
])
@pytest.mark.parametrize("k", [K, K + 4])  # inputs on and off the vectors' grid
def test_lora_rows_on_every_instruction_set_build(isa_build, row_slots,  # noqa: F811
                                                  k) -> None:
    from pagoda.executor.kernels import ops

    lib = ops.load_cpu_kernels()
    slots = adapters(k)
    torch.manual_seed(0)
    x, y = torch.randn(len(row_slots), k), torch.randn(len(row_slots), N)
    expected = reference(slots, row_slots, x, y)
    lora_add(lib, slots, row_slots, x, y)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for t, s in enumerate(row_slots):  # untouched rows are bit-equal
        if s < 0 or slots[s] is None:
            assert torch.equal(y[t], expected[t])


def test_many_rows_of_large_adapters_run_on_threads(tmp_path_factory) -> None:
    """Past LORA_PARALLEL_FLOATS weights a slot's shrink and expand are split over threads:
    the same sums."""
    lib = isa_library("native", tmp_path_factory)
    k, n = 512, 1024 + 48
    slots = [Fused(k, [(0, 1024, 16), (1024, 48, 16)], seed=4), Fused(k, [(0, 1072, 8)], seed=5)]
    row_slots = [0, 1] * 20 + [-1] * 3
    torch.manual_seed(1)
    x, y = torch.randn(len(row_slots), k), torch.randn(len(row_slots), n)
    expected = reference(slots, row_slots, x, y)
    lora_add(lib, slots, row_slots, x, y)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_an_adapter_that_does_not_fit_the_linear_is_refused() -> None:
    fused = Fused(K, [(0, 64, 8)], seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K + 32, N))
    with pytest.raises(ValueError, match="does not fit"):
        table_of([fused], Linear(K, 48))
