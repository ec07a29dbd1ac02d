"""Long-context rope scalings: YaRN and dynamic NTK, as Hugging Face configs give them, and the
context length each one extends a model to.

Both produce one set of inverse frequencies for every position (rotary.py precomputes cos/sin
from them), because a paged KV cache holds keys rotated once, when they were written:
- YaRN (Qwen2.5 / Qwen3 long context, DeepSeek, gpt-oss) is static in transformers too:
  `yarn_inv_freq` is transformers' `_compute_yarn_parameters`, step for step.
- Dynamic NTK in transformers recomputes the base from the current forward's length (a
  sequence longer than max_position_embeddings gets a larger base, all its positions
  re-rotated; within it, the plain base), which a cache of rotated keys cannot follow. Pagoda
  takes vLLM's static form: the base computed once, for a sequence of
  max_position_embeddings * factor tokens, at every position. It equals transformers' on a
  single forward of exactly that many tokens, and differs from it elsewhere (transformers
  itself is not consistent across a cached generation: keys cached at one step keep the base
  of that step).
"""

from __future__ import annotations

import math

import torch


def original_context_length(hf_config, params: dict) -> int:
    """The pretraining context YaRN stretches: as transformers' standardize_rope_params, a
    config-level `original_max_position_embeddings` first (Phi-3 keeps it there), then the rope
    settings', then max_position_embeddings."""
    value = (getattr(hf_config, "original_max_position_embeddings", None)
             or params.get("original_max_position_embeddings")
             or hf_config.max_position_embeddings)
    return int(value)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, eq. 21 of the paper: 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(hf_config, params: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: ((rotary_dim // 2,) float32 inverse frequencies, the factor cos and sin are
    multiplied by). Dimensions turning more than `beta_fast` times over the original context
    keep their frequency, those turning less than `beta_slow` times are divided by `factor`,
    the band between blended linearly (`truncate`: the band's ends rounded outwards)."""
    base = float(params["rope_theta"])
    dim = rotary_dim
    original = original_context_length(hf_config, params)
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3: the ratio of the two lengths
        factor = hf_config.max_position_embeddings / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits num_rotations times into the original context
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width band
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # (dim // 2,): 1 keeps the frequency, 0 divides it by factor
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


def dynamic_ntk_inv_freq(hf_config, params: dict, rotary_dim: int) -> torch.Tensor:
    """Dynamic NTK, static form (module docstring): (rotary_dim // 2,) float32 inverse
    frequencies of transformers' `_compute_dynamic_ntk_parameters` at seq_len =
    max_position_embeddings * factor, the base raised to
    base * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))."""
    base = float(params["rope_theta"])
    dim = rotary_dim
    factor = float(params["factor"])
    max_position_embeddings = hf_config.max_position_embeddings
    seq_len = max(max_position_embeddings * factor, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def scaled_context_length(hf_config, params: dict) -> int:
    """The longest context the model's rope settings are made for (vLLM's reading): YaRN's
    original context times its factor (or max_position_embeddings, if longer), dynamic NTK's
    max_position_embeddings times its factor, else max_position_embeddings."""
    context = int(getattr(hf_config, "max_position_embeddings", 2048))
    rope_type = params.get("rope_type")
    factor = params.get("factor")
    if rope_type == "yarn" and factor:
        return max(context, int(original_context_length(hf_config, params) * float(factor)))
    if rope_type == "dynamic" and factor:
        return max(context, int(context * float(factor)))
    return context
