"""SamplingMetadata: the sampler's per-step inputs as batched tensors, built once per step by
the model runner from the scheduled requests' SamplingParams (sampler.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step sampling tensors, built by the model runner from the scheduled requests.

    All tensors live on the logits' device. ``None`` means "no row needs this stage". Token id
    matrices are right-padded with ``vocab_size``, a column that is counted and then dropped.
    """

    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None  # (num_rows,) bool; None when all greedy/random
    temperature: torch.Tensor | None = None  # (num_rows,) float32, greedy rows 1.0
    top_k: torch.Tensor | None = None  # (num_rows,) int64; vocab_size where disabled
    max_top_k: int = 0  # largest enabled top_k (for the top-k-only path)
    top_p: torch.Tensor | None = None  # (num_rows,) float32
    min_p: torch.Tensor | None = None  # (num_rows,) float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded gen
    # logit_bias as sparse (row, token, value) triples, each (num_bias,)
    bias_row_ids: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # structured outputs: rows under a grammar and the tokens each allows
    grammar_row_ids: torch.Tensor | None = None  # (num_grammar_rows,) int64
    grammar_allowed: torch.Tensor | None = None  # (num_grammar_rows, vocab_size) bool
    # (row, token) pairs banned by min_tokens, each (num_banned,)
    banned_row_ids: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    # penalties; prompt ids only when some row has a repetition penalty
    prompt_token_ids: torch.Tensor | None = None  # (num_rows, max_prompt_len) int64, padded
    output_token_ids: torch.Tensor | None = None  # (num_rows, max_output_len) int64, padded
    repetition_penalties: torch.Tensor | None = None  # (num_rows,) float32
    frequency_penalties: torch.Tensor | None = None  # (num_rows,) float32
    presence_penalties: torch.Tensor | None = None  # (num_rows,) float32
    max_num_logprobs: int | None = None  # None: no row wants logprobs

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None

    @property
    def only_argmax(self) -> bool:
        """Every row greedy and nothing to apply to the logits or report: argmax is all."""
        return (self.all_greedy and self.max_num_logprobs is None and self.no_penalties
                and self.bias_row_ids is None and self.banned_row_ids is None
                and self.grammar_row_ids is None)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Turn the batch's params and token histories into tensors, one row per request.

        ``generators[i]`` is request i's own generator (created once from its seed and kept
        across steps by the model runner), or None for unseeded requests.
        """
        num_rows = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        meta = cls(vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random)
        if not all_greedy and not all_random:
            meta.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)

        if not all_greedy:
            temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
            if any(t != 1.0 for t in temps):
                meta.temperature = floats(temps)
            top_ks = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size
                      for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in top_ks):
                meta.top_k = ints(top_ks)
                meta.max_top_k = max(k for k in top_ks if k < vocab_size)
            if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
                meta.top_p = floats([p.top_p for p in params])
            if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
                meta.min_p = floats([p.min_p for p in params])
            meta.generators = {
                row: gen for row, (gen, g) in enumerate(zip(generators, greedy))
                if gen is not None and not g
            }

        bias_rows, bias_tokens, bias_values = [], [], []
        banned_rows, banned_tokens = [], []
        for row, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_tokens.append(token_id)
                bias_values.append(value)
            if len(output_token_ids[row]) < p.min_tokens:
                stop_ids = list(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stop_ids += eos_token_ids
                banned_rows += [row] * len(stop_ids)
                banned_tokens += stop_ids
        for token_id in bias_tokens + banned_tokens:  # (the InputProcessor checked them)
            assert 0 <= token_id < vocab_size, (
                f"token id {token_id} in logit_bias / stop_token_ids is out of the vocabulary"
            )
        if bias_rows:
            meta.bias_row_ids = ints(bias_rows)
            meta.bias_token_ids = ints(bias_tokens)
            meta.bias_values = floats(bias_values)
        if banned_rows:
            meta.banned_row_ids = ints(banned_rows)
            meta.banned_token_ids = ints(banned_tokens)

        if any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
               or p.presence_penalty != 0.0 for p in params):
            meta.output_token_ids = _pad(output_token_ids, vocab_size, device)
            meta.repetition_penalties = floats([p.repetition_penalty for p in params])
            meta.frequency_penalties = floats([p.frequency_penalty for p in params])
            meta.presence_penalties = floats([p.presence_penalty for p in params])
            if any(p.repetition_penalty != 1.0 for p in params):
                meta.prompt_token_ids = _pad(prompt_token_ids, vocab_size, device)

        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        if num_logprobs:
            meta.max_num_logprobs = max(num_logprobs)
        return meta


def _pad(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pad ragged token id lists into (num_rows, max_len) int64 (at least 1 column)."""
    max_len = max((len(ids) for ids in token_ids), default=0) or 1
    padded = [ids + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device)
