"""The structured-output stage of the sampler: a row under a grammar samples only tokens its
bitmask allows, rows without one are untouched, raw logprobs stay raw."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.executor.sampler import Sampler, unpack_bitmask
from pagoda.sampling_params import SamplingParams
from tests.executor.sampler_helpers import VOCAB, build, make_logits, seeded


def bitmask_allowing(rows: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    """(len(rows), ceil(vocab / 32)) int32 with exactly the given tokens' bits set."""
    bits = np.zeros((len(rows), -(-vocab // 32) * 32), dtype=np.uint8)
    for row, tokens in enumerate(rows):
        bits[row, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_unpack_bitmask_reads_every_bit_including_the_sign_bit():
    allowed = [[0, 5, 31], [1, 32, 63, 64], []]
    unpacked = unpack_bitmask(torch.from_numpy(bitmask_allowing(allowed, 70)), 70)
    assert unpacked.shape == (3, 70)
    assert [torch.nonzero(row).flatten().tolist() for row in unpacked] == allowed


def test_grammar_rows_sample_only_allowed_tokens_and_other_rows_are_untouched():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)]
    logits = make_logits(4)
    plain = Sampler()(logits.clone(), build(params, generators=[None, seeded(3), None, seeded(4)]))
    # rows 0 and 1 follow grammars that allow two tokens each, rows 2 and 3 none
    metadata = build(params, generators=[None, seeded(3), None, seeded(4)])
    metadata.grammar_row_ids = torch.tensor([0, 1])
    allowed = [[7, 9], [2, 30]]
    metadata.grammar_allowed = unpack_bitmask(torch.from_numpy(bitmask_allowing(allowed)), VOCAB)
    masked = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
    assert masked[0] == max(allowed[0], key=lambda t: logits[0, t])  # greedy within the mask
    assert masked[1] in allowed[1]
    assert masked[2:] == plain.sampled_token_ids.tolist()[2:]


def test_a_grammar_turns_off_the_argmax_fast_path_and_logprobs_stay_raw():
    params = [SamplingParams(temperature=0.0, logprobs=1)]
    logits = make_logits(1)
    metadata = build(params)
    assert metadata.only_argmax is False  # (logprobs asked)
    metadata = build([SamplingParams(temperature=0.0)])
    metadata.grammar_row_ids = torch.tensor([0])
    metadata.grammar_allowed = unpack_bitmask(torch.from_numpy(bitmask_allowing([[4]])), VOCAB)
    assert metadata.only_argmax is False
    assert Sampler()(logits.clone(), metadata).sampled_token_ids.tolist() == [4]
    metadata = build(params)
    metadata.grammar_row_ids = torch.tensor([0])
    metadata.grammar_allowed = unpack_bitmask(torch.from_numpy(bitmask_allowing([[4]])), VOCAB)
    out = Sampler()(logits.clone(), metadata)
    raw = torch.log_softmax(logits[0], -1)
    assert out.sampled_token_ids.tolist() == [4]
    assert torch.allclose(out.logprobs[0, 0], raw[4])  # the sampled token's unmasked logprob
