"""The whole-stack decode step: a decode step of a Llama-family model with packed weights in
one C call (csrc/decoder_f32.c), every decoder layer without per-op dispatch. One of the
step executors the model runner chooses between when it is built (model_runner.py: eager,
torch.compile, this); the model's own forward knows nothing of it.

At single-stream sizes the eager forward's dispatch of dozens of small ops a layer costs more
than its matmuls, so a decode-only step of a model that the kernel covers
runs its whole decoder stack in `pagoda_decode_layers_f32`; the embedding lookup, the final
norm and the head stay in Python (one op each). The kernel reuses the eager path's matmul,
attention and RMSNorm kernels, so its hidden states match the eager forward's to float32
rounding (tests/executor/test_decode_kernel.py).

What it covers, checked once per KV cache (`WholeStackDecode.plan`):
    - layers exactly Llama's (LlamaDecoderLayer, LlamaAttention, RMSNorm), each MLP a
      LlamaMLP with SiLU or a SparseMoeBlock of SwiGLU experts whose routing rule the C
      routing has (layers/moe_kernel.py): Llama, SmolLM, Mistral, Qwen2 (qkv bias), Qwen3
      (q/k norms), Phi-3, Mixtral, Qwen3-MoE, GLM-4.5, ERNIE 4.5 MoE; not Gemma, OLMoE or
      Granite;
    - every projection packed: a PackedLinear of at most MAX_SEGMENTS parts (a GGUF file's
      own types; `--quantization int4/int8`, AWQ / GPTQ folders: a QuantizedLinear on
      Pagoda's kernel with no float weight kept);
    - float32 activations and a float32 (or float16 / bfloat16) paged cache on the C attention
      backend, one KV-cache group;
and per step (`WholeStackDecode.forward`): a decode-only batch (each sequence's one new
token) of fewer than DEQUANTIZE_FROM_ROWS tokens. Anything else takes the eager forward.

LoRA adapters (--enable-lora): once `attach_lora` gave it the model's ModelLoRA, a step
whose rows run adapters (the step's LoRAStep: row_slots) runs in C too, each linear adding
its rows' adapters after the base matmul (csrc/lora_f32.c) from slot tables that
lora/whole_stack_tables.py rebuilds when the adapters in the slots change; without it such a
step takes the eager forward (its hooks add the adapters).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend, KernelDecodeGroup
from pagoda.executor.forward_context import get_forward_context
from pagoda.executor.kernels.abi import Decoder, DecoderLayer, DecoderLinear, kv_cache_format
from pagoda.executor.kernels.ops import (
    DEQUANTIZE_FROM_ROWS,
    SIXTEEN_BIT_CACHES,
    kernels_available,
    load_cpu_kernels,
)
from pagoda.executor.layers.activation import SiluAndMul
from pagoda.executor.layers.moe import SparseMoeBlock
from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.layers.packed_linear import decoder_linear
from pagoda.executor.lora.step import current_lora_step
from pagoda.executor.lora.whole_stack_tables import LoRATables
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
)


class WholeStackDecode:
    """Over a LlamaModel (`model.model` of a Llama-family model: `for_model`); the model
    runner owns it. `enabled = False` turns it off (tests compare both paths)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.enabled = True
        self._plan: Decoder | None = None
        self._planned_for: object = None  # the first layer's KV cache the plan was made for
        self._keep: list = []  # the ctypes arrays the plan points into
        self._moe_plans: list = []  # the MoE layers' plans (layers/moe_kernel.py) it points to
        self._lora: LoRATables | None = None
        """The slot tables of the model's ModelLoRA (--enable-lora: attach_lora)."""

    @classmethod
    def for_model(cls, model: nn.Module) -> WholeStackDecode | None:
        """Over `model`'s decoder stack where it is a LlamaModel (the kernel may still not
        cover it: `plan`), else None."""
        stack = getattr(model, "model", None)
        return cls(stack) if type(stack) is LlamaModel else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states (T, hidden), the model's final norm applied, or None
        where this step or model takes the eager forward. Inside the step's forward
        context."""
        if not self.enabled:
            return None
        per_kv_group = get_forward_context()
        if len(per_kv_group) != 1:
            return None  # the C step reads one block table: no sliding-window groups
        metadata = per_kv_group[0]
        groups = getattr(metadata, "backend_data", None)
        num_tokens = input_ids.shape[0]
        if (not groups or len(groups) != 1 or not isinstance(groups[0], KernelDecodeGroup)
                or groups[0].query_token_index is not None
                or groups[0].num_seqs != num_tokens or num_tokens >= DEQUANTIZE_FROM_ROWS):
            return None
        step = current_lora_step()
        if step is not None and self._lora is None:
            return None  # adapter rows and no tables: the eager forward's hooks add them
        plan = self.plan()
        if plan is None:
            return None
        row_slots = None
        if step is not None:
            row_slots = step.row_slots
            if row_slots.shape != (num_tokens,) or row_slots.dtype != np.int32 \
                    or not row_slots.flags.c_contiguous \
                    or int(row_slots.max()) >= len(self._lora.model_lora.slots):
                raise ValueError(f"a LoRA step's row_slots {row_slots!r} do not fit its "
                                 f"{num_tokens} rows and "
                                 f"{len(self._lora.model_lora.slots)} slots")
            self._lora.install(plan)
        group = groups[0]
        hidden = self.model.embed_tokens(input_ids)
        if hidden.dtype != torch.float32:
            return None
        x = hidden.contiguous()  # a fresh tensor: the kernel adds the layers into it
        positions = positions.to(torch.int64).contiguous()
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        key_lens = group.seq_lens.contiguous()
        tables = group.block_tables.contiguous()
        load_cpu_kernels().pagoda_decode_layers_f32(
            ctypes.byref(plan), num_tokens, x.data_ptr(), positions.data_ptr(),
            tables.data_ptr(), tables.shape[1], key_lens.data_ptr(), slots.data_ptr(),
            None if row_slots is None else row_slots.ctypes.data)
        return self.model.norm(x)

    def attach_lora(self, model_lora) -> bool:
        """Run steps with adapter rows in C over `model_lora` (a ModelLoRA attached to this
        model: its `hooked` modules must be the layers' qkv / o / gate_up / down, as without
        tensor parallelism). False, and such steps stay eager, where they are not."""
        expected = []
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, getattr(layer, layer.mlp_name, None)
            expected.append([attention.qkv_proj, attention.o_proj,
                             getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)])
        hooked = model_lora.hooked
        if len(hooked) != len(expected) or any(
                len(ours) != len(theirs) or any(a is not b for a, b in zip(ours, theirs))
                for ours, theirs in zip(hooked, expected)):
            self._lora = None
            return False
        self._lora = LoRATables(model_lora)
        return True

    def plan(self) -> Decoder | None:
        """The model's C description for its current KV caches, made on first use; None
        where the model is not one the kernel covers."""
        layers = self.model.layers
        first_cache = layers[0].self_attn.attn.kv_cache
        if first_cache is None:
            return None
        if self._planned_for is not first_cache:
            self._plan = self._describe()
            self._planned_for = first_cache
        return self._plan

    def forget_plan(self) -> None:
        """Plan again at the next step: after a layer's settings changed (tests set a
        window on a model that has none)."""
        self._planned_for = None

    def _describe(self) -> Decoder | None:
        model = self.model
        if not kernels_available(torch.float32):
            return None
        rotary = model.rotary
        cos, sin = rotary.cos_cache, rotary.signed_sin_cache
        if cos.dtype != torch.float32 or cos.device.type != "cpu" or not cos.is_contiguous():
            return None
        described, self._moe_plans = [], []
        for layer in model.layers:
            described.append(self._describe_layer(layer))
            if described[-1] is None:
                return None
        attention = model.layers[0].self_attn
        kv_cache = attention.attn.kv_cache
        dense_widths = [mlp.down_proj.in_features for mlp in
                        (getattr(layer, layer.mlp_name) for layer in model.layers)
                        if type(mlp) is LlamaMLP]
        layers = (DecoderLayer * len(described))(*described)
        self._keep = [layers, cos, sin, self._moe_plans]  # a block may re-plan: keep ours
        return Decoder(
            num_layers=len(described), hidden=model.norm.weight.shape[0],
            num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim, intermediate=max(dense_widths, default=0),
            rotary_dim=rotary.rotary_dim, num_blocks=kv_cache.shape[2],
            block_size=kv_cache.shape[3], eps=model.norm.eps,
            kv_format=-1 if kv_cache.dtype == torch.float32 else kv_cache_format(
                SIXTEEN_BIT_CACHES[kv_cache.dtype]),
            cos_cache=cos.data_ptr(),
            signed_sin_cache=sin.data_ptr(), layers=layers)

    def _describe_layer(self, layer: nn.Module) -> DecoderLayer | None:
        attention = layer.self_attn
        mlp = getattr(layer, layer.mlp_name, None)
        attn = attention.attn
        first = self.model.layers[0]
        moe = mlp.kernel_plan() if type(mlp) is SparseMoeBlock else None
        self._moe_plans.append(moe)
        if type(layer) is not LlamaDecoderLayer or type(attention) is not LlamaAttention:
            return None  # (DeepSeek's latent attention among them)
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attention.q_norm is not None:
            norms += [attention.q_norm, attention.k_norm]
        if (not (type(mlp) is LlamaMLP and type(mlp.act) is SiluAndMul
                        or moe is not None and moe.routed)
                or any(type(n) is not RMSNorm or n.eps != self.model.norm.eps
                       or n.weight.dtype != torch.float32 for n in norms)
                or attention.rotary is not self.model.rotary or attn.logit_softcap is not None
                or attn.sinks is not None or attn.chunk is not None
                or not isinstance(attn.backend, CpuKernelAttentionBackend)
                or attn.backend is not first.self_attn.attn.backend or attn.kv_cache_group != 0
                or type(attn.kv_cache) is not torch.Tensor
                or attn.kv_cache.dtype not in (torch.float32, *SIXTEEN_BIT_CACHES)
                or attn.kv_cache.dtype != first.self_attn.attn.kv_cache.dtype
                or attn.kv_cache.shape != first.self_attn.attn.kv_cache.shape):
            return None
        mlp_linears = [DecoderLinear(), DecoderLinear()] if moe is not None else [
            decoder_linear(mlp.gate_up_proj), decoder_linear(mlp.down_proj)]
        linears = [decoder_linear(attention.qkv_proj), decoder_linear(attention.o_proj),
                   *mlp_linears]
        if any(linear is None for linear in linears):
            return None
        window = attn.sliding_window if attn.sliding_window is not None else attn.backend.sliding_window
        return DecoderLayer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
            q_norm=None if attention.q_norm is None else attention.q_norm.weight.data_ptr(),
            k_norm=None if attention.k_norm is None else attention.k_norm.weight.data_ptr(),
            qkv=linears[0], o=linears[1], gate_up=linears[2], down=linears[3],
            moe=None if moe is None else ctypes.pointer(moe.moe),
            kv_cache=attn.kv_cache.data_ptr(), window=window or 0, scale=attn.scale)


