"""The one validation step: every bad prompt is an InvalidRequestError naming its field and
code, raised before anything is queued; good ones come out as plain EngineRequests."""

from __future__ import annotations

import pytest

from pagoda.engine.core.input_processor import InputProcessor
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams


class WordTokenizer:
    """One token per word: ids are word lengths (enough to check tokenization happens)."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


@pytest.fixture
def processor() -> InputProcessor:
    return InputProcessor(WordTokenizer(), vocab_size=100, max_model_len=10)


def refusal(processor, prompt, params=None, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        processor.process("r", prompt, params or SamplingParams(), **kwargs)
    return caught.value


def test_text_is_tokenized_and_max_tokens_capped_to_the_room_left(processor):
    request = processor.process("r", "a bb ccc", SamplingParams(max_tokens=50), priority=3,
                                arrival_time=12.0)
    assert (request.prompt, request.prompt_token_ids) == ("a bb ccc", [1, 2, 3])
    assert (request.max_tokens, request.priority, request.arrival_time) == (7, 3, 12.0)
    assert processor.process("r", [4, 5], SamplingParams(max_tokens=None)).max_tokens == 8
    assert processor.process("r", [4, 5], SamplingParams(max_tokens=3)).max_tokens == 3
    ids = processor.process("r", "ignored", SamplingParams(), prompt_token_ids=[9])
    assert ids.prompt_token_ids == [9]


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ("", "prompt is empty"),
    ([1, 100], "prompt token id 100 is out of range"),
    ([1, -1], "prompt token id -1 is out of range"),
    ([1, "a"], "prompt token id 'a' is out of range"),
    (5, "prompt must be a string or a list of token ids"),
])
def test_bad_prompts_name_the_prompt(processor, prompt, message):
    error = refusal(processor, prompt)
    assert error.param == "prompt" and error.code == "invalid_value"
    assert message in str(error)


def test_context_length_errors_carry_the_numbers_and_the_endpoints_names(processor):
    error = refusal(processor, list(range(1, 11)), prompt_param="messages")
    assert (error.param, error.code) == ("messages", "context_length_exceeded")
    assert "10 tokens" in str(error) and "messages" in str(error)
    error = refusal(processor, [1, 2, 3], SamplingParams(max_tokens=8), reject_over_length=True,
                    max_tokens_param="max_completion_tokens")
    assert (error.param, error.code) == ("max_completion_tokens", "context_length_exceeded")
    assert all(n in str(error) for n in ("10", "11", "3", "8"))


@pytest.mark.parametrize("field, params", [
    ("logit_bias", SamplingParams(logit_bias={100: 1.0})),
    ("stop_token_ids", SamplingParams(stop_token_ids=[5, 100])),
])
def test_token_ids_in_params_must_be_in_the_vocabulary(processor, field, params):
    error = refusal(processor, [1], params)
    assert error.param == field and "vocabulary" in str(error)
