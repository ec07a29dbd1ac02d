"""A loaded linear layer or embedding, cut to some of its output rows or input columns, in
whatever form its weight is held:

    Linear / MergedLinear (float)         the weight's rows or columns (a plain Linear back)
    PackedLinear (a GGUF file's types)    each segment's tiles (rows) or input blocks (columns)
    QuantizedLinear on Pagoda's kernel    its codes are one packed segment: a PackedLinear back
    QuantizedLinear, dense kernel         its float codes, as a Linear
    nn.Embedding / PackedEmbedding        the table's rows (vocabulary entries)

Packed bounds must fall on the format's grid: outputs on tiles of TILE_N, inputs on the
quantization blocks (PackedWeight.input_block); `row_align` / `column_align` say what a
module needs, and a cut off the grid raises ValueError. A weight in torch's int4 layout
(QuantizedLinear's torch-int4 kernel) cannot be cut: ValueError.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.kernels.packed_weight import PackedWeight
from pagoda.executor.kernels.packing import TILE_N
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.packed_linear import PackedEmbedding, PackedLinear
from pagoda.executor.layers.quantization import QuantizedLinear


def _as_packed_or_float(module: nn.Module) -> tuple[list[PackedWeight] | None, torch.Tensor | None]:
    """(packed segments, None) or (None, float weight (out, in))."""
    if isinstance(module, PackedLinear) and module.segments:
        return list(module.segments), None
    if isinstance(module, QuantizedLinear):  # a fallback kernel's (no C compiler)
        if module.kernel == "dense":
            return None, module.fallback_codes
        raise ValueError(
            f"tensor parallelism cannot split a {module.method} layer on the {module.kernel} "
            f"kernel (torch's int4 layout); use --quantization none or a GGUF file")
    if isinstance(module, Linear):
        return None, module.weight.data
    raise ValueError(f"tensor parallelism cannot split a {type(module).__name__}")


def row_align(module: nn.Module) -> int:
    """Output rows a cut of `module` must fall on multiples of."""
    packed, _ = _as_packed_or_float(module)
    return 1 if packed is None else TILE_N


def column_align(module: nn.Module) -> int:
    """Input columns a cut of `module` must fall on multiples of."""
    packed, _ = _as_packed_or_float(module)
    return 1 if packed is None else max(w.input_block() for w in packed)


def linear_rows(module: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """A layer computing `module`'s outputs in `ranges` ([start, stop) each), in that order."""
    packed, weight = _as_packed_or_float(module)
    bias = module.bias
    new_bias = None if bias is None else torch.cat([bias[a:b] for a, b in ranges]).clone()
    if packed is None:
        rows = torch.cat([weight[a:b] for a, b in ranges]).clone()
        return _float_linear(rows, new_bias)
    parts, offset = [], 0
    for segment in packed:  # segment covers outputs [offset, offset + out_features)
        for index, (start, stop) in enumerate(ranges):
            a, b = max(start, offset), min(stop, offset + segment.out_features)
            if a < b:
                parts.append((index, segment.rows(a - offset, b - offset)))
        offset += segment.out_features
    parts.sort(key=lambda part: part[0])  # range order (stable: segment order within one)
    return PackedLinear([_own_copy(part) for _, part in parts], new_bias)


def linear_columns(module: nn.Module, start: int, stop: int, keep_bias: bool) -> nn.Module:
    """A layer computing `module`'s product over inputs [start, stop) only (a row-parallel
    layer's share: the ranks' results sum to the whole); the bias only where `keep_bias`."""
    packed, weight = _as_packed_or_float(module)
    bias = module.bias if keep_bias else None
    if packed is None:
        return _float_linear(weight[:, start:stop].clone(), bias)
    return PackedLinear([segment.columns(start, stop) for segment in packed], bias)


def embedding_rows(module: nn.Module, start: int, stop: int) -> nn.Module:
    """The embedding of vocabulary entries [start, stop) (looked up by id - start)."""
    if isinstance(module, PackedEmbedding):
        return PackedEmbedding(_own_copy(module.table.rows(start, stop)), module.dtype)
    if isinstance(module, nn.Embedding):
        table = module.weight.data[start:stop].clone()
        embedding = nn.Embedding(stop - start, table.shape[1], _weight=table)
        embedding.weight.requires_grad_(False)
        return embedding
    raise ValueError(f"tensor parallelism cannot split a {type(module).__name__} embedding")


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out_features, in_features = weight.shape
    linear = Linear.__new__(Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return linear


def _own_copy(weight: PackedWeight) -> PackedWeight:
    """A weight whose planes hold only its own rows (row views would keep the whole table)."""
    return PackedWeight(weight.format, weight.out_features, weight.in_features,
                        {name: p.clone() for name, p in weight.planes.items()})
