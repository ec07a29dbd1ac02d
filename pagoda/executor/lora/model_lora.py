"""ModelLoRA: adapters added to a built model's linear outputs by forward hooks, never merged
into its weights (so any base linear serves: float, packed GGUF types, int8/int4, AWQ/GPTQ,
a tensor-parallel shard).

Attached once per model (runner_builder.py, with --enable-lora). Per decoder layer it hooks
four modules, in this order (`hooked[layer]`):

    qkv_proj, o_proj, gate_up_proj, down_proj
    (o_proj / down_proj under tensor parallelism: RowParallelLinear.inner, this rank's
    input columns, so that the layer's all-reduce sums the ranks' partial deltas)

and holds, per hooked module, every loaded adapter's FusedLoRA keyed by lora_int_id
(`adapters[layer][module]`; absent: the adapter has none of that module's targets).
A hook adds, for each adapter of the step (step.py), out[rows] += delta(x[rows]); a step
without adapter rows costs each hook one ContextVar lookup.

`slots` (max_loras entries: the lora_int_id each slot holds, None: free) numbers the
adapters a step may use, for the whole-stack C decode (its slot tables, rebuilt when
`version` changes: any change of slots or loaded adapters bumps it) and for the step's
`row_slots`. The manager (manager.py) decides what is loaded and which slot holds what.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.lora.fused import MODULE_TARGETS, FusedLoRA, ModuleShape, fuse, storage_dtype
from pagoda.executor.lora.step import current_lora_step
from pagoda.executor.models.llama import head_dim_of


class ModelLoRA:
    def __init__(self, model: nn.Module, max_loras: int,
                 device: torch.device | None = None, row_wise: bool = False) -> None:
        """`model`: a Llama-family causal LM (layers with self_attn.qkv_proj / o_proj and an
        MLP with gate_up_proj / down_proj), possibly a tensor-parallel rank's share; its
        adapters' tensors live on `device` (default: the model's). ValueError for a model
        whose layers are not so. `row_wise`: every row's delta computed alone
        (--deterministic)."""
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device
        self.slots: list[int | None] = [None] * max_loras
        self.version = 0
        self.hooked: list[list[nn.Module]] = []
        self.shapes: list[list[ModuleShape]] = []
        self.adapters: list[list[dict[int, FusedLoRA]]] = []
        self.loaded: dict[int, int] = {}
        """lora_int_id -> bytes its fused tensors hold (on this rank)."""
        self._handles = []
        for layer in _decoder_layers(model):
            modules, shapes = _layer_modules(model.config, layer)
            self.hooked.append(modules)
            self.shapes.append(shapes)
            self.adapters.append([{} for _ in modules])
            for module, adapters in zip(modules, self.adapters[-1]):
                self._handles.append(module.register_forward_hook(_hook(adapters, row_wise)))

    @property
    def num_layers(self) -> int:
        return len(self.hooked)

    # ---- adapters ----------------------------------------------------------------------------

    def add_adapter(self, lora_int_id: int, pairs: dict) -> None:
        """Fuse an adapter's pairs ({(layer, target): LoRAPair}, B pre-scaled: the files'
        load_lora_weights) into every hooked module, kept in the pairs' own dtype (fused.py's
        storage_dtype: the loader applied --lora-dtype). ValueError naming what does not fit
        (a layer the model lacks, an unknown target, shapes), before anything is added."""
        targets = {t for names in MODULE_TARGETS.values() for t in names}
        for layer, target in pairs:
            if target not in targets or not 0 <= layer < self.num_layers:
                raise ValueError(f"LoRA adapter {lora_int_id}: layer {layer} {target} is not "
                                 f"one of this model's {self.num_layers} layers' projections")
        dtype = storage_dtype(pairs)
        fused = [[_on(fuse(shape, pairs, layer, dtype), self.device) for shape in shapes]
                 for layer, shapes in enumerate(self.shapes)]
        self.remove_adapter(lora_int_id)
        size = 0
        for per_module, adapters in zip(fused, self.adapters):
            for one, held in zip(per_module, adapters):
                if one is not None:
                    held[lora_int_id] = one
                    size += one.nbytes
        self.loaded[lora_int_id] = size
        self.version += 1

    def remove_adapter(self, lora_int_id: int) -> None:
        """Drop an adapter's tensors and free its slot (a no-op for one not loaded)."""
        if lora_int_id not in self.loaded:
            return
        del self.loaded[lora_int_id]
        for adapters in self.adapters:
            for held in adapters:
                held.pop(lora_int_id, None)
        self.slots = [None if s == lora_int_id else s for s in self.slots]
        self.version += 1

    def set_slot(self, slot: int, lora_int_id: int | None) -> None:
        assert lora_int_id is None or lora_int_id in self.loaded, lora_int_id
        if self.slots[slot] != lora_int_id:
            self.slots[slot] = lora_int_id
            self.version += 1

    def fused(self, layer: int, module: int, lora_int_id: int) -> FusedLoRA | None:
        """The adapter's FusedLoRA on hooked[layer][module] (None: none of its targets)."""
        return self.adapters[layer][module].get(lora_int_id)

    def detach(self) -> None:
        """Remove the hooks (the model runs as if never attached)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _hook(adapters: dict[int, FusedLoRA], row_wise: bool):
    """A forward hook adding the step's adapters (their rows) to a module's output."""

    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
        step = current_lora_step()
        if step is None or not adapters:
            return None
        x = inputs[0]
        for lora_int_id, rows in step.groups:
            fused = adapters.get(lora_int_id)
            if fused is None:
                continue
            if isinstance(rows, slice):
                fused.add_to(out[rows], x[rows], row_wise)
            else:
                rows = rows.to(out.device)
                out.index_add_(0, rows, fused.delta(x[rows], out.shape[-1], row_wise)
                               .to(out.dtype))
        return out

    return hook


def _on(fused: FusedLoRA | None, device: torch.device) -> FusedLoRA | None:
    return None if fused is None else fused.to(device)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    stack = getattr(model, "model", None)
    layers = getattr(stack, "layers", None)
    if layers is None:
        raise ValueError(f"LoRA adapters are served on Llama-family models, not "
                         f"{type(model).__name__}")
    return list(layers)


def _layer_modules(config, layer: nn.Module) -> tuple[list[nn.Module], list[ModuleShape]]:
    """The four modules of a layer to hook and how their outputs and inputs sit in the
    adapter's whole matrices (parallel/sharding.py records a shard's rows and columns)."""
    attention = getattr(layer, "self_attn", None)
    mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"), None)
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    owners = (attention, attention, mlp, mlp)
    found = [getattr(owner, name, None) for owner, name in zip(owners, names)]
    if any(module is None for module in found):
        raise ValueError(f"LoRA adapters need layers with q/k/v, o, gate/up and down "
                         f"projections; a {type(layer).__name__} with a "
                         f"{type(mlp).__name__} MLP does not have them all")
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    hidden = config.hidden_size
    qkv, o, gate_up, down = found
    o, o_columns, o_in = _row_parallel(o, q_size)
    down, down_columns, intermediate = _row_parallel(down, down.in_features)
    modules = [qkv, o, gate_up, down]
    shapes = [
        ModuleShape(MODULE_TARGETS["qkv_proj"], (q_size, kv_size, kv_size), hidden,
                    _rows(qkv, (q_size, kv_size, kv_size))),
        ModuleShape(MODULE_TARGETS["o_proj"], (hidden,), o_in, ((0, hidden),), o_columns),
        ModuleShape(MODULE_TARGETS["gate_up_proj"], (intermediate, intermediate), hidden,
                    _rows(gate_up, (intermediate, intermediate))),
        ModuleShape(MODULE_TARGETS["down_proj"], (hidden,), intermediate, ((0, hidden),),
                    down_columns),
    ]
    return modules, shapes


def _row_parallel(module: nn.Module, whole_in: int
                  ) -> tuple[nn.Module, tuple[int, int] | None, int]:
    """(the module to hook, the input columns it sees, the whole input size): a
    RowParallelLinear's inner with the columns sharding recorded, else the module whole."""
    columns = getattr(module, "columns", None)
    if columns is not None and hasattr(module, "inner"):
        return module.inner, tuple(columns), module.whole_in_features
    return module, None, whole_in


def _rows(module: nn.Module, sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Each part's own output rows the module computes: sharding's record, else all."""
    rows = getattr(module, "shard_rows", None)
    return tuple(map(tuple, rows)) if rows is not None else tuple((0, n) for n in sizes)
