"""SamplingParams: defaults, normalisation and validation (no model, no torch)."""

from __future__ import annotations

import pytest

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams


def test_sampling_params_defaults_and_normalisation() -> None:
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=None)
    assert p.top_k == 0 and p.stop == ["###"] and p.stop_token_ids == []
    d = SamplingParams()
    assert (d.n, d.temperature, d.top_p, d.top_k, d.min_p, d.max_tokens, d.min_tokens) == (
        1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert d.stop == [] and d.logprobs is None and d.skip_special_tokens
    assert SamplingParams(max_tokens=None).max_tokens is None
    c = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    clone = c.clone()
    assert clone == c and clone.stop is not c.stop and clone.logit_bias is not c.logit_bias


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),  # each completion is a sequence: bounded as OpenAI bounds it
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"repetition_penalty": 1e7}, "repetition_penalty"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_sampling_params_validation(kwargs: dict, field_name: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    error = caught.value
    assert isinstance(error, ValueError)  # callers that catch ValueError still do
    assert (error.param, error.code) == (field_name, "invalid_value")
    assert error.message == str(error) and error.message.startswith(f"{field_name} ")


def test_temperature_error_message() -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_error_renamed_for_an_endpoint_speaks_its_field_name() -> None:
    """Chat calls SamplingParams' logprobs `top_logprobs`: the error is rendered again under
    that name, its detail and code kept."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logprobs=30)
    renamed = caught.value.renamed("top_logprobs")
    assert renamed.param == "top_logprobs" and renamed.code == "invalid_value"
    assert renamed.message == "top_logprobs must be an int in [0, 20] or None, got 30"
    assert str(renamed) == renamed.message
    assert caught.value.param == "logprobs"  # the original is unchanged
    # An error whose message does not start with the field keeps its message.
    plain = InvalidRequestError("the prompt is too long", "prompt", "context_length_exceeded")
    moved = plain.renamed("messages")
    assert (moved.message, moved.param, moved.code) == (
        "the prompt is too long", "messages", "context_length_exceeded")
