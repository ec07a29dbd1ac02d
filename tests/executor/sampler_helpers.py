"""Builders shared by the sampler's tests (test_sampler.py, test_logits_processors.py)."""

from __future__ import annotations

import torch

from pagoda.executor.sampler import Sampler, SamplerOutput
from pagoda.executor.sampling_metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams

VOCAB = 32
EOS = 3
CPU = torch.device("cpu")


def make_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=gen) * 2  # (num_rows, vocab)


def build(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab: int = VOCAB,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts if prompts is not None else [[1, 2]] * n,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        eos_token_ids=[EOS],
        vocab_size=vocab,
        device=CPU,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> SamplerOutput:
    # the sampler modifies logits in place; keep the caller's copy intact
    return Sampler()(logits.clone(), build(params, vocab=logits.shape[1], **kwargs))


def sampled_ids(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> list[int]:
    return sample(logits, params, **kwargs).sampled_token_ids.tolist()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
