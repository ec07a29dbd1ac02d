"""Fill a model's linear layers with weights a checkpoint holds already quantized.

Both quantized loaders (AWQ/GPTQ folders: hf_quantized.py; GGUF files: gguf_packed.py) need
the same bookkeeping: a checkpoint linear (e.g. `model.layers.0.self_attn.k_proj`) may be one
part of a fused module (`qkv_proj`, shard "k"); the module's float weight is dropped before
loading starts (load_weights then expects none), each part is kept as it arrives, and the
module is replaced by a quantized layer as soon as its last part is in:

    targets   checkpoint linear -> (module name, shard id or None)
    parts     module name -> {shard id: converted part or None (not yet loaded)}
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagoda.executor.layers.linear import Linear


def linear_target(model: nn.Module, prefix: str) -> tuple[str, object]:
    """The (module name, shard id) a checkpoint linear `prefix` loads into."""
    name = prefix + "."
    for fused, part, shard_id in getattr(model, "stacked_params", ()):
        if part in name:
            return name.replace(part, fused)[:-1], shard_id
    return prefix, None


def model_linear(model: nn.Module, module_name: str) -> Linear | None:
    """The `Linear` (or fused linear) named `module_name`, or None where there is none."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module if isinstance(module, Linear) else None


class QuantizedLinearParts:
    """`make_layer(module, parts)` builds the quantized layer that replaces `module` from its
    parts in shard order; it must have the module's (out_features, in_features)."""

    def __init__(self, model: nn.Module, targets: dict[str, tuple[str, object]],
                 make_layer: Callable[[Linear, list], nn.Module]) -> None:
        self.model, self.targets, self.make_layer = model, targets, make_layer
        wanted: dict[str, set] = {}
        for module_name, shard in targets.values():
            wanted.setdefault(module_name, set()).add(shard)
        self.parts: dict[str, dict] = {}
        for module_name, shards in wanted.items():
            module = self._linear(module_name)
            expected = [None] if None in shards else list(getattr(module, "shard_offsets", [None]))
            if shards != set(expected):
                raise ValueError(f"{module_name}: the checkpoint quantizes parts {sorted(shards)}"
                                 f" of {expected}; all of them or none must be quantized")
            self.parts[module_name] = dict.fromkeys(expected)
            del module.weight  # never filled: the quantized layer replaces it
            module.weight = None

    def _linear(self, module_name: str) -> Linear:
        module = model_linear(self.model, module_name)
        if module is None:
            raise ValueError(f"quantized checkpoint tensors for {module_name!r}: the model has "
                             "no linear layer of that name")
        return module

    def add(self, prefix: str, part) -> None:
        """Keep checkpoint linear `prefix`'s converted part; install its module when whole."""
        module_name, shard = self.targets[prefix]
        self.parts[module_name][shard] = part
        if all(p is not None for p in self.parts[module_name].values()):
            self._install(module_name, list(self.parts.pop(module_name).values()))

    def _install(self, module_name: str, parts: list) -> None:
        module = self._linear(module_name)
        layer = self.make_layer(module, parts)
        shape = (layer.out_features, layer.in_features)
        if shape != (module.out_features, module.in_features):
            raise ValueError(f"{module_name}: quantized weight {shape} does not match "
                             f"({module.out_features}, {module.in_features})")
        parent_name, _, child = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, layer)

    def missing(self) -> list[str]:
        """Modules some of whose parts never arrived, with the shard ids they lack."""
        return [f"{m} (parts {[s for s, p in parts.items() if p is None]})"
                for m, parts in self.parts.items()]
