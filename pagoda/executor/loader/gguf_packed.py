"""Load a GGUF file's quantized matrices packed, in their own types, never as float.

Each quantized tensor's blocks go straight into the kernels' packed layout
(pagoda/executor/kernels/packed_weight.py; gguf_packing.py: pack_gguf), one tensor at a time as the file is
read; a mixed file (a Q4_K_M holds Q4_K, Q5_0, Q6_K and Q8_0 tensors) runs each in its own
type. What is packed:

    decoder linears      -> PackedLinear (a fused qkv / gate-up of mixed types: segments)
    token embedding      -> PackedEmbedding (a lookup decodes only its rows)
    logits head          -> model.quantized_head: the embedding's own table when tied
    everything else      -> the run dtype, as before (norms, routers, float matrices)

A fused module is packed only if every part is (all its parts quantized, in packable types
and shapes): else all of its parts load as float. So is a matrix the kernels cannot take
(outputs not a multiple of 16 rows). A type without a packed kernel of its own is re-encoded
without loss where another format holds its values (Q3_K, IQ3_S and TQ2_0 as Q6_K, IQ4_NL and
MXFP4 as Q8_0: gguf_exact_repacking.py), else requantized to Q8_0 as it is packed (Q2_K,
IQ4_XS, the 1- and 2-bit i-quants, TQ1_0), with one log line naming the types and their
tensor counts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

from pagoda.executor.kernels.packed_weight import PackedWeight
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.packed_linear import PackedEmbedding, PackedLinear
from pagoda.executor.loader.gguf_exact_repacking import exact_target
from pagoda.executor.loader.gguf_loader import GGUFCheckpoint, RawGGUFTensor
from pagoda.executor.loader.gguf_packing import (
    GGUF_FORMATS,
    REQUANTIZED_AS,
    gguf_type_packable,
    pack_gguf,
)
from pagoda.executor.loader.heap import release_freed_memory
from pagoda.executor.loader.linear_parts import (
    QuantizedLinearParts,
    linear_target,
    model_linear,
)

logger = logging.getLogger(__name__)

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class PackedGGUFLoader:
    """Built before load_weights (it drops the float weights it will replace); `weights`
    feeds load_weights the float tensors and keeps the packed ones; `finish` checks that
    every packed module was completed and sets the head."""

    def __init__(self, model: nn.Module, checkpoint: GGUFCheckpoint, dtype: torch.dtype) -> None:
        self.model, self.checkpoint, self.dtype = model, checkpoint, dtype
        matrices = {name: spec for name, spec in checkpoint.quantized_matrices().items()
                    if gguf_type_packable(*spec)}
        targets = self._linear_targets(matrices)
        self.raw_names = {prefix + ".weight" for prefix in targets}
        # a plain function, not a bound method: a method would make loader -> linears ->
        # loader a cycle that keeps the checkpoint's file mapping resident until a gc pass
        self.linears = QuantizedLinearParts(model, targets, _packed_linear)
        self.embedding: PackedWeight | None = None
        self.head: PackedWeight | None = None
        self.pack_embedding = EMBEDDING in matrices
        self.pack_head = HEAD in matrices and getattr(model, "lm_head", None) is not None
        if self.pack_embedding:
            _drop_weight(model.model.embed_tokens)
            self.raw_names.add(EMBEDDING)
        if self.pack_head:
            _drop_weight(model.lm_head)
            self.raw_names.add(HEAD)
        self.formats: Counter[str] = Counter()
        self.requantized: Counter[str] = Counter()
        """source GGUF type name -> tensors requantized to REQUANTIZED_AS"""
        self.repacked: Counter[str] = Counter()
        """"SOURCE as TARGET" -> tensors whose values TARGET's format holds exactly"""

    def _linear_targets(self, matrices: dict) -> dict[str, tuple[str, object]]:
        """checkpoint linear -> (module, shard) for the modules whose parts all pack."""
        by_module: dict[str, dict[str, object]] = {}
        packable_weights = {name.removesuffix(".weight") for name in matrices
                            if name.endswith(".weight")}
        for name in self.checkpoint.tensor_names():
            prefix, _, kind = name.rpartition(".")
            if kind != "weight" or name in (EMBEDDING, HEAD):
                continue
            module_name, shard = linear_target(self.model, prefix)
            if model_linear(self.model, module_name) is not None:
                by_module.setdefault(module_name, {})[prefix] = shard
        targets = {}
        for module_name, prefixes in by_module.items():
            if all(prefix in packable_weights for prefix in prefixes):
                targets.update((prefix, (module_name, shard)) for prefix, shard in prefixes.items())
        return targets

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's float tensors for load_weights; the packed ones are kept here."""
        for name, tensor in self.checkpoint.iter_weights(dtype, frozenset(self.raw_names)):
            if not isinstance(tensor, RawGGUFTensor):
                yield name, tensor
                continue
            try:
                packed = pack_gguf(tensor.data, tensor.ggml_type, tensor.shape)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            self.formats[packed.format] += 1
            if tensor.ggml_type not in GGUF_FORMATS:
                exact = exact_target(tensor.ggml_type, tensor.data)
                if exact:
                    self.repacked[f"{tensor.ggml_type.name} as {exact.name}"] += 1
                else:
                    self.requantized[tensor.ggml_type.name] += 1
            release_freed_memory()  # the slices' temporaries: never a heap of them at once
            if name == EMBEDDING:
                self.embedding = packed
            elif name == HEAD:
                self.head = packed
            else:
                self.linears.add(name.removesuffix(".weight"), packed)

    def finish(self) -> None:
        """After load_weights: install the embedding and head; everything packed arrived."""
        missing = self.linears.missing()
        if self.pack_embedding and self.embedding is None:
            missing.append(EMBEDDING)
        if self.pack_head and self.head is None:
            missing.append(HEAD)
        if missing:
            raise ValueError(f"GGUF file lacks tensors of: {', '.join(missing[:8])}")
        if self.embedding is not None:
            self.model.model.embed_tokens = PackedEmbedding(self.embedding, self.dtype)
        if self.head is not None:  # the packed head takes the float one's place
            bias = self.model.lm_head.bias  # (PhiMoE's; None elsewhere)
            self.model.lm_head = self.model.quantized_head = PackedLinear([self.head], bias)
        elif self.embedding is not None and getattr(self.model, "lm_head", None) is None:
            self.model.quantized_head = PackedLinear([self.embedding])  # tied: one table
        logger.info("packed GGUF weights: %s", ", ".join(
            f"{count} {fmt}" for fmt, count in sorted(self.formats.items())))
        if self.repacked:
            logger.info("GGUF types packed, without loss, in another kernel format: %s",
                        ", ".join(f"{name} ({count} tensors)"
                                  for name, count in sorted(self.repacked.items())))
        if self.requantized:
            logger.warning("GGUF types without a packed kernel, requantized to %s at load: %s",
                           REQUANTIZED_AS.name, ", ".join(
                               f"{name} ({count} tensors)"
                               for name, count in sorted(self.requantized.items())))


def _packed_linear(module: Linear, parts: list[PackedWeight]) -> nn.Module:
    return PackedLinear(parts, module.bias)


def _drop_weight(module: nn.Module) -> None:
    """Remove a module's float weight before loading (load_weights then expects none)."""
    del module.weight
    module.weight = None
