"""The sampler: one batched pass from logits to next tokens (and logprobs).

Input is a ``(num_rows, vocab_size)`` logits tensor, one row per scheduled request, in the
model's dtype, and a ``SamplingMetadata`` built once per step. Every stage works on the whole
batch and is skipped when no row needs it; the only per-request Python loop draws the random
numbers of seeded rows. A batch of greedy rows with nothing to apply is one argmax in the
logits' own dtype; otherwise the stages run on float32 logits, modified in place (float32
input itself, or a copy in a buffer the sampler reuses).

Pipeline, in order (the logits processors of steps 4 and 7 live in logits_processors.py):
    1. raw logprobs: ``log_softmax`` of the model's logits, before any processing (as vLLM v1
       does), computed only if some row asked for logprobs
    2. structured outputs: rows under a grammar get -inf for every token their bitmask
       refuses (one masked_fill over those rows); then logit_bias: each row's bias values are
       added to its logits
    3. min_tokens: rows with fewer than ``min_tokens`` output tokens get their stop token ids
       (EOS unless ``ignore_eos``, plus ``stop_token_ids``) set to -inf
    4. penalties: repetition (tokens seen in prompt + output: positive logits divided,
       negative multiplied), then frequency (``-= freq * count``) and presence
       (``-= presence * (count > 0)``), counts over the output only
    5. greedy rows: argmax; if every row is greedy, skip to 9
    6. temperature: logits divided by each row's temperature (greedy rows by 1)
    7. top-k and top-p masks (one sort), then min-p on the probabilities
    8. sample by inverse CDF: one uniform number per row picks the token where the row's
       cumulative weight passes it (see ``random_sample``); a seeded row draws its number from
       its request's own generator, so its tokens do not depend on the rest of the batch;
       unseeded rows share one batched draw; a row whose weights are not finite (processing
       overflowed) gets NO_TOKEN, and the runner fails its request alone
    9. logprobs: for the sampled token its raw logprob and rank, plus the top-N raw logprobs
       (N = the largest number asked for in the batch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.executor.logits_processors import apply_min_p, apply_penalties, apply_top_k_top_p
from pagoda.executor.sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """The tokens sampled this step, one per row, and their logprobs if some row asked.

    Logprob tensors cover every row; the caller keeps the rows (and the first ``1 + logprobs``
    columns) that each request asked for.
    """

    sampled_token_ids: torch.Tensor  # (num_rows,) int64; NO_TOKEN where a row had no
    # usable probabilities (a penalty or temperature drove its logits out of float range)
    logprob_token_ids: torch.Tensor | None = None  # (num_rows, 1 + N) int64: sampled, top-N
    logprobs: torch.Tensor | None = None  # (num_rows, 1 + N) float32, raw logprobs
    sampled_token_ranks: torch.Tensor | None = None  # (num_rows,) int64, 1 = most likely


class Sampler(torch.nn.Module):
    """Logits -> next tokens; see the module docstring for the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        # reused float32 copy of non-float32 logits: a fresh (256, 49152) float32 tensor per
        # step is a new 50 MB mapping whose page faults cost more than the copy itself
        self._float_logits: torch.Tensor | None = None

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits (num_rows, vocab_size) in any float dtype
        if metadata.only_argmax:
            return SamplerOutput(sampled_token_ids=_argmax(logits))  # exact in any dtype
        logits, raw_logprobs = self.process(logits, metadata)
        sampled = _sample(logits, metadata)  # 5.-8.

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        token_ids, logprobs, ranks = gather_logprobs(  # 9.
            raw_logprobs, sampled, metadata.max_num_logprobs
        )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=token_ids,
            logprobs=logprobs,
            sampled_token_ranks=ranks,
        )

    def process(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1-4: (float32 logits with grammar, bias, min_tokens and penalties applied,
        raw logprobs or None). The logits are modified in place (or a buffer copy is)."""
        logits = self._as_float32(logits)  # modified in place from step 2 on
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # 1. a new tensor

        if metadata.grammar_row_ids is not None:  # 2.
            rows = metadata.grammar_row_ids
            logits[rows] = logits[rows].masked_fill(~metadata.grammar_allowed, float("-inf"))
        if metadata.bias_row_ids is not None:
            logits.index_put_(
                (metadata.bias_row_ids, metadata.bias_token_ids),
                metadata.bias_values,
                accumulate=True,
            )
        if metadata.banned_row_ids is not None:  # 3.
            logits[metadata.banned_row_ids, metadata.banned_token_ids] = float("-inf")
        if not metadata.no_penalties:  # 4.
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalties,
                metadata.frequency_penalties,
                metadata.presence_penalties,
                metadata.vocab_size,
            )
        return logits, raw_logprobs

    def _as_float32(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits: the tensor itself when it is float32, else a copy in the reused
        buffer (valid until the next call)."""
        if logits.dtype == torch.float32:
            return logits
        rows, vocab_size = logits.shape
        buffer = self._float_logits
        if (buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab_size
                or buffer.device != logits.device):
            buffer = self._float_logits = torch.empty(
                rows, vocab_size, dtype=torch.float32, device=logits.device
            )
        return buffer[:rows].copy_(logits)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32, bit t of a row = token t allowed -> (rows, vocab_size) bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # (rows, words, 32); bit 31 too (& 1)
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """(num_rows, vocab_size) -> (num_rows,) int64, the first maximum of each row.
    ``max(dim).indices`` rather than ``argmax``: same result, faster on CPU in bf16
    (measured in BENCHMARKS.md)."""
    return logits.max(dim=-1).indices


def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 5-8: greedy argmax and/or random sampling. Returns (num_rows,) int64."""
    greedy_tokens = None
    if not metadata.all_random:
        greedy_tokens = _argmax(logits)  # 5.
        if metadata.all_greedy:
            return greedy_tokens
    probs = probabilities(logits, metadata)
    random_tokens = random_sample(probs, metadata.generators)  # 8.
    if greedy_tokens is None:
        return random_tokens
    return torch.where(metadata.greedy_mask, greedy_tokens, random_tokens)


def probabilities(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 6-7 on processed float32 logits, in place: the distribution random rows sample
    from, unnormalised (num_rows, vocab_size). Greedy rows come out at temperature 1."""
    if metadata.temperature is not None:
        logits.div_(metadata.temperature.unsqueeze(1))  # 6.
    if metadata.top_k is not None or metadata.top_p is not None:  # 7.
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    # unnormalised probabilities exp(logit - row max), in place: min-p and random_sample need
    # no normalisation, and a new (num_rows, vocab_size) tensor costs page faults on a CPU
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    return probs


CDF_BLOCK = 256  # tokens per block in random_sample's two-level search
NO_TOKEN = -1
"""The sampled id of a row that could not be sampled (its probabilities were not finite)."""


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: the token where the row's cumulative weight first passes
    ``u * total``, with one ``u ~ U[0, 1)`` per row.

    probs (num_rows, vocab_size), non-negative, need not be normalised; not modified. Seeded rows
    draw their ``u`` from their own generator (one number per step), the others share one draw.
    Returns (num_rows,) int64.

    One random number per row, not one per token: drawing ``vocab_size`` numbers per row (the
    exponential race, ``argmax(probs / Exp(1))``) costs more than a whole decode step at a
    large batch. The search has two levels so that it stays accurate and cheap: block sums
    (``CDF_BLOCK`` tokens each, float32) cumulated in float64 find the block, then a float64
    cumulative sum inside that one block finds the token. A zero-weight token is never picked.
    """
    num_rows, vocab_size = probs.shape
    device = probs.device
    u = draw_uniforms(num_rows, generators, device)
    # block sums, (rows, num_blocks); a vocabulary off the block grid ends in a short block
    # (no padded copy of probs: that would be a whole (rows, vocab_size) copy a step)
    whole = vocab_size - vocab_size % CDF_BLOCK
    block_sums = probs[:, :whole].view(num_rows, -1, CDF_BLOCK).sum(dim=-1)
    if whole < vocab_size:
        block_sums = torch.cat([block_sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block_cdf = block_sums.double().cumsum(dim=-1)
    target = u.unsqueeze(1) * block_cdf[:, -1:]  # (rows, 1), below the row's total
    block = _first_passing(block_cdf, target)  # (rows, 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    positions = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=device)  # (rows, CDF_BLOCK)
    chosen = probs.gather(1, positions.clamp(max=vocab_size - 1))
    chosen.masked_fill_(positions >= vocab_size, 0.0)  # past the short last block
    token = _first_passing(chosen.double().cumsum(dim=-1), target - before)  # (rows, 1)
    # A row whose weights sum to nothing usable (NaN, infinity or zero: processing went out
    # of float range) has no token: NO_TOKEN, for the runner to fail that request alone.
    total = block_cdf[:, -1]
    usable = torch.isfinite(total) & (total > 0)
    return torch.where(usable, (block * CDF_BLOCK + token).squeeze(1), NO_TOKEN)


def draw_uniforms(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """(num_rows,) float64 ~ U[0, 1): seeded rows from their own generator, the others from
    one shared draw."""
    if len(generators) < num_rows:
        u = torch.rand(num_rows, dtype=torch.float64, device=device)
    else:
        u = torch.empty(num_rows, dtype=torch.float64, device=device)
    for row, generator in generators.items():
        u[row] = torch.rand((), dtype=torch.float64, generator=generator, device=device)
    return u


def _first_passing(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """cdf (rows, n) non-decreasing, target (rows, 1) -> (rows, 1) int64: the first index whose
    cumulative value exceeds target, capped at the last index that adds weight (so rounding
    that puts target at or past the total still lands on a token with weight)."""
    passing = torch.searchsorted(cdf, target, right=True)
    last_with_weight = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(passing, last_with_weight)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick each row's token logprob, its rank and the row's top ``num_top`` logprobs.

    logprobs (n, vocab_size); token_ids (n,). Returns ids (n, 1 + num_top) int64 and
    logprobs (n, 1 + num_top), the given token first then the top ones in descending order, and
    ranks (n,) int64: 1 + the number of tokens with a strictly larger logprob.
    ``num_top`` is capped at vocab_size.
    """
    token_ids = token_ids.long().unsqueeze(1)  # (n, 1)
    token_logprobs = logprobs.gather(1, token_ids)  # (n, 1)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # (n,)
    num_top = min(num_top, logprobs.shape[-1])
    if num_top == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # (n, num_top) each
    return (
        torch.cat([token_ids, top_ids], dim=1),
        torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks,
    )


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of given tokens (prompt_logprobs): logits (n, V) float32, token_ids (n,).

    Returns (ids (n, 1 + num_top), logprobs (n, 1 + num_top), ranks (n,)); see
    ``gather_logprobs``. Does not modify logits.
    """
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_top)
