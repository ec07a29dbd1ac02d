"""How closely a faster mode (bf16, quantized weights, an 8-bit KV cache, other kernels) follows the float32 run
of the same weights, measured the way llama.cpp's `llama-perplexity --kl-divergence` does.

Teacher forcing: both models read the same real texts; at every scored position we compare
their next-token distributions:
- top-1 agreement: the share of positions where both models' most likely token is the same
  (llama.cpp's "Same top p");
- mean KL divergence KL(reference || candidate) over the vocabulary (llama.cpp's "Mean KLD");
- each model's perplexity on the actual next tokens.
Each text is scored from `score_from` on (llama-perplexity scores the second half of each
context window, so that every scored token has context behind it; 0 scores every position).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.executor.model_runner import ModelRunner


@dataclass(frozen=True)
class FidelityReport:
    num_positions: int
    top1_agreement: float
    """Share of positions where both models' most likely next token is the same."""
    mean_kl_divergence: float
    """Mean over positions of KL(reference || candidate), in nats."""
    reference_perplexity: float
    candidate_perplexity: float

    @property
    def perplexity_delta(self) -> float:
        return self.candidate_perplexity - self.reference_perplexity

    @property
    def top1_standard_error(self) -> float:
        """Binomial standard error of top1_agreement over num_positions."""
        p = self.top1_agreement
        return math.sqrt(max(p * (1 - p), 1e-12) / self.num_positions)

    def summary(self) -> str:
        return (f"{self.num_positions} positions: top-1 {self.top1_agreement:.2%} "
                f"(+-{self.top1_standard_error:.2%}), mean KL {self.mean_kl_divergence:.3g}, "
                f"perplexity {self.reference_perplexity:.4f} -> {self.candidate_perplexity:.4f}")


def next_token_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab) float32 logits predicting tokens 1.. of `token_ids`."""
    return runner.prompt_logits([token_ids])[0][:-1].float().cpu()


def compare_teacher_forced(
    reference: ModelRunner | list[torch.Tensor], candidate: ModelRunner,
    texts: list[list[int]], score_from: int = 0,
) -> FidelityReport:
    """Score `candidate` against `reference` (a runner, or its next_token_logits for each of
    `texts`, computed once and reused) over the positions of each text from `score_from` on."""
    agree = kl = ref_nll = cand_nll = 0.0
    count = 0
    for i, token_ids in enumerate(texts):
        ref_logits = (reference[i] if isinstance(reference, list)
                      else next_token_logits(reference, token_ids))[score_from:]
        cand_logits = next_token_logits(candidate, token_ids)[score_from:]
        targets = torch.tensor(token_ids[1:])[score_from:]
        ref_logprobs = F.log_softmax(ref_logits, dim=-1)
        cand_logprobs = F.log_softmax(cand_logits, dim=-1)
        agree += (ref_logits.argmax(-1) == cand_logits.argmax(-1)).sum().item()
        kl += (ref_logprobs.exp() * (ref_logprobs - cand_logprobs)).sum().item()
        ref_nll -= ref_logprobs.gather(1, targets[:, None]).sum().item()
        cand_nll -= cand_logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return FidelityReport(count, agree / count, kl / count, math.exp(ref_nll / count),
                          math.exp(cand_nll / count))


def build_runner(dtype: torch.dtype, quantization: str | None, model: str | None = None,
                 max_len: int = 2048, kv_cache_dtype: str = "auto") -> ModelRunner:
    """A CPU runner of `model` (default: the bundled one) in one mode, with a KV cache for a
    `max_len`-token text, for teacher forcing. `kv_cache_dtype`: CacheConfig's (an 8-bit
    cache is written, then read, by the prefill itself: every position attends quantized
    keys and values, its own included, as in decoding)."""
    from pagoda.config import CacheConfig
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.model_loader import load_model, open_checkpoint

    files = resolve_model_files(model)
    loaded = load_model(open_checkpoint(files), dtype, torch.device("cpu"),
                        max_position=max_len, quantization=quantization)
    runner = ModelRunner(loaded, torch.device("cpu"), dtype,
                         CacheConfig(kv_cache_dtype=kv_cache_dtype), [])
    runner.initialize_kv_cache([max_len // runner.block_size + 2] * runner.num_kv_cache_groups)
    return runner


@contextlib.contextmanager
def decode_kernels_only(runner: ModelRunner):
    """Within the block, every quantized matmul of `runner` takes the small-batch kernel that
    decode steps run (no float weight kept for large batches, no dequantized BLAS matmul), so
    teacher forcing over a whole text measures what decoding computes."""
    from pagoda.executor.kernels import ops
    from pagoda.executor.layers.quantization import QuantizedLinear

    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    kept = [layer.dense_weight for layer in layers]
    threshold = ops.DEQUANTIZE_FROM_ROWS
    for layer in layers:
        layer.dense_weight = None
    ops.DEQUANTIZE_FROM_ROWS = 1 << 62
    try:
        yield
    finally:
        ops.DEQUANTIZE_FROM_ROWS = threshold
        for layer, weight in zip(layers, kept):
            layer.dense_weight = weight


def context_windows(token_ids: list[int], n_ctx: int) -> list[list[int]]:
    """The whole n_ctx-token windows of one token stream, as llama-perplexity cuts them
    (score each from n_ctx // 2 to compare with its figures)."""
    return [token_ids[i:i + n_ctx] for i in range(0, len(token_ids) - n_ctx + 1, n_ctx)]
