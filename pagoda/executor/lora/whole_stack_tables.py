"""The whole-stack decode step's LoRA slot tables (csrc/lora_f32.c, kernels.h's
pagoda_lora_slot): ModelLoRA's adapters (executor/lora/model_lora.py) described to C, so a
decode step whose rows run adapters still takes the one C call.

    per layer, per linear (qkv, o, gate_up, down: ModelLoRA.hooked's order)
        a LoRASlot * max_loras array, entry s = the FusedLoRA of ModelLoRA.slots[s] there
        (a NULL: the slot is free, or its adapter has none of that linear's targets);
        NULL for a linear no slotted adapter touches (the C step skips it outright)

The tables point straight into the FusedLoRAs' own tensors, A (R, in) and each part's
b_t (rank, out_size), in their storage dtype (float32, bfloat16 or float16: the slot's
LoRADtype; C widens each element to float32 as it loads it): nothing is copied, an adapter's
numbers are held once. The tables keep the FusedLoRAs they point into alive. They are
rebuilt only when ModelLoRA.version changes (any slot or adapter change bumps it) and
written into a plan's linears once per (plan, version): a step pays a version comparison.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagoda.executor.kernels.abi import MAX_LORA_PARTS, Decoder, LoRADtype, LoRASlot

LINEARS = ("qkv", "o", "gate_up", "down")
"""DecoderLayer's linears, in ModelLoRA.hooked[layer]'s order."""


SLOT_DTYPES = {torch.float32: LoRADtype.F32, torch.bfloat16: LoRADtype.BF16,
               torch.float16: LoRADtype.F16}
"""A FusedLoRA's storage dtype -> the slot's LORA_* code."""


def fill_slot(slot: LoRASlot, fused, module: nn.Module) -> None:
    """Describe one FusedLoRA (A (R, in), parts' b_t (rank, out_size), one storage dtype)
    over `module` in `slot`, pointing at its own tensors; ValueError where it does not fit
    the module (the C step would read past its buffers or misread its numbers)."""
    a = fused.a
    if (a.dtype not in SLOT_DTYPES or a.device.type != "cpu" or not a.is_contiguous()
            or a.dim() != 2 or a.shape[1] != module.in_features
            or len(fused.parts) > MAX_LORA_PARTS
            or any(p.out_offset + p.out_size > module.out_features
                   or p.rank_offset + p.rank > a.shape[0]
                   or p.b_t.dtype != a.dtype or not p.b_t.is_contiguous()
                   or tuple(p.b_t.shape) != (p.rank, p.out_size) for p in fused.parts)):
        raise ValueError(f"a LoRA adapter's A {tuple(a.shape)} ({a.dtype}) with "
                         f"{len(fused.parts)} parts does not fit "
                         f"{type(module).__name__}({module.in_features}, "
                         f"{module.out_features}) in the whole-stack decode step")
    slot.a, slot.dtype = a.data_ptr(), SLOT_DTYPES[a.dtype]
    slot.total_rank, slot.num_parts = a.shape[0], len(fused.parts)
    for described, part in zip(slot.parts, fused.parts):
        described.b_t, described.out_offset = part.b_t.data_ptr(), part.out_offset
        described.out_size, described.rank_offset = part.out_size, part.rank_offset
        described.rank = part.rank


class LoRATables:
    """Over one ModelLoRA (duck-typed: `slots`, `version`, `num_layers`, `hooked`,
    `fused(layer, module, lora_int_id)`)."""

    def __init__(self, model_lora) -> None:
        self.model_lora = model_lora
        self._version: int | None = None
        self._tables: list[list[ctypes.Array | None]] = []
        self._pointed: list = []
        """The FusedLoRAs the tables point into (held while they do)."""
        self._installed: tuple[Decoder, int] | None = None

    def install(self, plan: Decoder) -> None:
        """Point `plan`'s linears at the tables of the adapters slotted now."""
        version = self.model_lora.version
        if self._version != version:
            self._rebuild()
        if self._installed is not None and self._installed[0] is plan \
                and self._installed[1] == version:
            return
        num_slots = len(self.model_lora.slots)
        for index in range(plan.num_layers):
            layer = plan.layers[index]  # a view into the plan's array: writes land there
            for name, table in zip(LINEARS, self._tables[index], strict=True):
                linear = getattr(layer, name)
                linear.lora = None if table is None else ctypes.cast(
                    table, ctypes.POINTER(LoRASlot))
                linear.num_lora_slots = 0 if table is None else num_slots
        self._installed = (plan, version)

    def _rebuild(self) -> None:
        lora = self.model_lora
        slots, pointed, tables = list(lora.slots), [], []
        for layer in range(lora.num_layers):
            per_layer = []
            for linear, module in enumerate(lora.hooked[layer]):
                table, used = (LoRASlot * len(slots))(), False
                for index, lora_int_id in enumerate(slots):
                    fused = None if lora_int_id is None else lora.fused(layer, linear,
                                                                         lora_int_id)
                    if fused is None:
                        continue
                    fill_slot(table[index], fused, module)
                    pointed.append(fused)
                    used = True
                per_layer.append(table if used else None)
            tables.append(per_layer)
        self._pointed, self._tables, self._version = pointed, tables, lora.version
        self._installed = None
