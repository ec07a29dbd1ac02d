"""The C library's interface in one place: the format codes of csrc/kernels.h, its structs'
ctypes mirrors and every exported entry's ctypes signature. tests/executor/test_kernel_abi.py
parses kernels.h and checks all three against this module, so a changed prototype or code fails there, not as a
crash or a silently wrong argument.

Imports nothing of Pagoda (every other kernel-facing module imports it)."""

from __future__ import annotations

import ctypes
from enum import IntEnum


class WeightFormat(IntEnum):
    """FORMAT_* of kernels.h: the packed weight formats (kernels.h describes each layout)."""

    Q4 = 0
    Q8 = 1
    Q5 = 2
    Q4K = 3
    Q5K = 4
    Q6K = 5


class KVCacheFormat(IntEnum):
    """KV_* of kernels.h: the 8-bit KV cache formats (attention/kv_quant.py) and the 16-bit
    ones under float32 activations."""

    INT8 = 0
    FP8_E4M3 = 1
    FP8_E5M2 = 2
    FLOAT16 = 3
    BFLOAT16 = 4


def weight_format(name: str) -> int:
    """A packed format's name ("q4", "q6k", ...) -> its FORMAT_* code."""
    return int(WeightFormat[name.upper()])


def kv_cache_format(name: str) -> int:
    """A KV cache dtype ("int8", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16") -> its KV_*
    code."""
    return int(KVCacheFormat[name.upper()])


_int, _i64, _f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_PLANES = [_ptr] * 6
"""codes, high, scales, mins, sub_scales, sub_mins (packed_weight.PLANE_NAMES)"""


class AttentionArgs(ctypes.Structure):
    """struct pagoda_attention_args of kernels.h, field for field: every paged attention
    entry's one argument (csrc/attention_driver.h has the contract)."""

    _fields_ = [
        ("query", _ptr), ("kv_cache", _ptr), ("kv_scales", _ptr), ("block_tables", _ptr),
        ("query_seq", _ptr), ("key_lens", _ptr), ("new_k", _ptr), ("new_v", _ptr),
        ("slots", _ptr), ("out", _ptr), ("num_tokens", _i64), ("num_heads", _i64),
        ("num_kv_heads", _i64), ("head_dim", _i64), ("num_blocks", _i64),
        ("block_size", _i64), ("table_width", _i64), ("window", _i64), ("k_stride", _i64),
        ("v_stride", _i64), ("scale", _f32), ("kv_format", _int),
    ]


MAX_SEGMENTS = 4
"""kernels.h: parts of one fused projection in the whole-stack decoder (DecoderLinear)"""


class DecoderSegment(ctypes.Structure):
    """struct pagoda_decoder_segment: one packed weight, a column block of a linear."""

    _fields_ = [("format", _i64), ("out_features", _i64), ("codes", _ptr), ("high", _ptr),
                ("scales", _ptr), ("mins", _ptr), ("sub_scales", _ptr), ("sub_mins", _ptr)]


MAX_LORA_PARTS = 3
"""kernels.h: adapted projections in one fused linear (q, k, v of qkv_proj; LoRASlot)"""


class LoRAPart(ctypes.Structure):
    """struct pagoda_lora_part: one adapted projection of a fused linear, its B transposed
    (rank, out_size), pre-scaled, in its slot's dtype."""

    _fields_ = [("b_t", _ptr), ("out_offset", _i64), ("out_size", _i64),
                ("rank_offset", _i64), ("rank", _i64)]


class LoRADtype(IntEnum):
    """LORA_* of kernels.h: the numbers a LoRASlot's A and B^T are stored in (the kernel
    widens each to float32 as it loads it)."""

    F32 = 0
    BF16 = 1
    F16 = 2


class LoRASlot(ctypes.Structure):
    """struct pagoda_lora_slot: one adapter over one linear (a NULL: none); A (total_rank,
    in_features) stacks its parts' A; `dtype` a LoRADtype, of A and every part's B^T."""

    _fields_ = [("a", _ptr), ("dtype", _i64), ("total_rank", _i64), ("num_parts", _i64),
                ("parts", LoRAPart * MAX_LORA_PARTS)]


class DecoderLinear(ctypes.Structure):
    """struct pagoda_decoder_linear: y = x W^T (+ bias), W the segments' rows in turn, plus
    each row's LoRA adapter from `lora` (num_lora_slots LoRASlots, or NULL)."""

    _fields_ = [("num_segments", _i64), ("in_features", _i64), ("out_features", _i64),
                ("segments", DecoderSegment * MAX_SEGMENTS), ("bias", _ptr),
                ("activation_parts", _i64), ("lora", ctypes.POINTER(LoRASlot)),
                ("num_lora_slots", _i64)]


class MoEExpert(ctypes.Structure):
    """struct pagoda_moe_expert: one SwiGLU expert, gate_up rows [gate | up]."""

    _fields_ = [("gate_up", DecoderLinear), ("down", DecoderLinear)]


MOE_ROUTINGS = {"softmax_top_k": 0, "top_k_softmax": 1, "sigmoid_biased": 2,
                "softmax_biased": 3}
"""kernels.h's MOE_* routing rules by name."""
MAX_EXPERT_GROUPS = 64
"""kernels.h: the most expert groups a biased router's C routing takes"""


class MoE(ctypes.Structure):
    """struct pagoda_moe: a sparse MoE MLP's router and experts (layers/moe_kernel.py)."""

    _fields_ = [("num_experts", _i64), ("top_k", _i64), ("routing", _i64), ("normalize", _i64),
                ("n_group", _i64), ("topk_group", _i64), ("routed_scaling_factor", _f32),
                ("router", _ptr), ("correction_bias", _ptr),
                ("experts", ctypes.POINTER(MoEExpert)), ("shared", ctypes.POINTER(MoEExpert))]


class DecoderLayer(ctypes.Structure):
    """struct pagoda_decoder_layer: one Llama-family decoder layer."""

    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("q_norm", _ptr),
                ("k_norm", _ptr), ("qkv", DecoderLinear), ("o", DecoderLinear),
                ("gate_up", DecoderLinear), ("down", DecoderLinear),
                ("moe", ctypes.POINTER(MoE)), ("kv_cache", _ptr),
                ("window", _i64), ("scale", _f32)]


class Decoder(ctypes.Structure):
    """struct pagoda_decoder: pagoda_decode_layers_f32's model (whole_stack_decode.py
    fills it)."""

    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("rotary_dim", _i64), ("num_blocks", _i64), ("block_size", _i64),
                ("eps", _f32), ("kv_format", _int), ("cos_cache", _ptr),
                ("signed_sin_cache", _ptr),
                ("layers", ctypes.POINTER(DecoderLayer))]


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "pagoda_attention_args": AttentionArgs, "pagoda_decoder_segment": DecoderSegment,
    "pagoda_decoder_linear": DecoderLinear, "pagoda_lora_part": LoRAPart,
    "pagoda_lora_slot": LoRASlot, "pagoda_decoder_layer": DecoderLayer,
    "pagoda_moe_expert": MoEExpert, "pagoda_moe": MoE,
    "pagoda_decoder": Decoder,
}
"""The structs of kernels.h: struct tag -> its ctypes mirror."""
_ATTENTION = [ctypes.POINTER(AttentionArgs)]
_GEMM_Q = [_int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
_GEMM_PACKED = [_int, _ptr, _i64, _i64, _i64, *_PLANES, _ptr]

SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    # avx512_bf16.c
    "pagoda_bf16_kernels_available": (_int, []),
    "pagoda_gemm_q_bf16": (None, _GEMM_Q),
    "pagoda_paged_attention_bf16": (None, _ATTENTION),
    # gemm_f32.c, gemm_dequantize_f32.c
    "pagoda_f32_vector_bytes": (_int, []),
    "pagoda_gemm_q_f32": (None, _GEMM_Q),
    "pagoda_dequantize_q_f32": (None, [_int, _i64, _i64, _ptr, _ptr, _ptr, _ptr]),
    "pagoda_gemm_packed_f32": (None, _GEMM_PACKED),
    "pagoda_gemm_packed_rowwise_f32": (None, _GEMM_PACKED),
    "pagoda_gemm_packed_int8_f32": (None, [_int, _int, *_GEMM_PACKED[1:]]),
    "pagoda_amx_available": (_int, []),
    "pagoda_set_amx_min_rows": (None, [_int, _int]),
    "pagoda_dequantize_packed_f32": (None, [_int, _i64, _i64, *_PLANES, _ptr]),
    "pagoda_dequantize_packed_bf16": (None, [_int, _i64, _i64, *_PLANES, _ptr]),
    "pagoda_dequantize_rows_packed_f32": (None, [_int, _i64, _i64, *_PLANES, _ptr, _i64, _ptr]),
    # attention_f32.c (paged attention: attention_driver.c)
    "pagoda_paged_attention_f32": (None, _ATTENTION),
    "pagoda_paged_attention_q8_f32": (None, _ATTENTION),
    "pagoda_paged_attention_h16_f32": (None, _ATTENTION),
    "pagoda_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr, _ptr]),
    # decoder_f32.c (the model: a Decoder, whole_stack_decode.py fills it)
    "pagoda_silu_and_mul_f32": (None, [_ptr, _i64, _i64, _ptr]),
    "pagoda_decode_layers_f32": (None, [ctypes.POINTER(Decoder), _i64, _ptr, _ptr, _ptr, _i64,
                                        _ptr, _ptr, _ptr]),
    # moe_f32.c (sparse MoE MLPs: the eager block's small batches, the decode step's layers)
    "pagoda_moe_route_f32": (None, [ctypes.POINTER(MoE), _ptr, _i64, _i64, _ptr, _ptr]),
    "pagoda_moe_f32": (None, [ctypes.POINTER(MoE), _ptr, _i64, _i64, _ptr, _ptr, _ptr]),
    # lora_f32.c (per-row adapters: the decode step's, also callable alone)
    "pagoda_lora_add_f32": (None, [ctypes.POINTER(LoRASlot), _i64, _ptr, _ptr, _i64, _i64,
                                   _ptr, _i64]),
}
"""Every entry of kernels.h: name -> (restype, argtypes)."""
BF16_ENTRIES = ("pagoda_gemm_q_bf16", "pagoda_paged_attention_bf16")
"""Built only where the CPU (or the emulation build) has AVX-512 BF16."""


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set every entry's signature on a loaded library (the bf16 ones only where it has
    them: pagoda_bf16_kernels_available() is checked before they are looked up)."""
    has_bf16 = bool(lib.pagoda_bf16_kernels_available())
    for name, (restype, argtypes) in SIGNATURES.items():
        if name in BF16_ENTRIES and not has_bf16:
            continue
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib
