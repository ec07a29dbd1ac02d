"""The request lifecycle: the one place that applies every stop rule and owns the
parent/child map of n > 1. Driven without a model: tokens are handed in as the scheduler
would after a step."""

from __future__ import annotations

import pytest

from pagoda.engine.core.input_processor import InputProcessor
from pagoda.engine.core.lifecycle import RequestLifecycle
from pagoda.engine.core.request import RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput

EOS = 2
MAX_MODEL_LEN = 64


@pytest.fixture
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


@pytest.fixture
def lifecycle(tokenizer):
    return RequestLifecycle(tokenizer, [EOS], MAX_MODEL_LEN)


def add(lifecycle, tokenizer, request_id, params, prompt="Hello there"):
    processor = InputProcessor(tokenizer, len(tokenizer), MAX_MODEL_LEN)
    return lifecycle.add_request(processor.process(request_id, prompt, params))


def feed(lifecycle, sequences, token_ids):
    """One step in which each sequence got one token (appended as the scheduler does)."""
    new_tokens = []
    for sequence, token_id in zip(sequences, token_ids):
        sequence.append_output_token(token_id)
        new_tokens.append((sequence, token_id))
    ids = [s.request_id for s in sequences]
    output = ModelRunnerOutput(ids, list(token_ids))
    return dict(lifecycle.process_step(new_tokens, output, now=1.0))


def word_id(tokenizer, word: str) -> int:
    [token_id] = tokenizer.encode(word)
    return token_id


def test_each_stop_rule_ends_its_sequence_with_the_right_reason(lifecycle, tokenizer):
    stop_word = word_id(tokenizer, " stop")
    other = word_id(tokenizer, " go")
    eos, = add(lifecycle, tokenizer, "eos", SamplingParams(max_tokens=10))
    stop_id, = add(lifecycle, tokenizer, "stop_id", SamplingParams(max_tokens=10,
                                                                  stop_token_ids=[other]))
    stop_str, = add(lifecycle, tokenizer, "stop_str", SamplingParams(max_tokens=10,
                                                                    stop=["stop"]))
    length, = add(lifecycle, tokenizer, "length", SamplingParams(max_tokens=1))
    ignore, = add(lifecycle, tokenizer, "ignore", SamplingParams(max_tokens=10, ignore_eos=True))
    finished = feed(lifecycle, [eos, stop_id, stop_str, length, ignore],
                    [EOS, other, stop_word, other, EOS])
    assert finished == {
        "eos": RequestStatus.FINISHED_STOPPED, "stop_id": RequestStatus.FINISHED_STOPPED,
        "stop_str": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
    }
    outputs = {o.request_id: o.outputs[0] for o in lifecycle.make_outputs()}
    reasons = {rid: (o.finish_reason, o.stop_reason) for rid, o in outputs.items()}
    assert reasons == {
        "eos": ("stop", None), "stop_id": ("stop", other), "stop_str": ("stop", "stop"),
        "length": ("length", None), "ignore": (None, None),
    }
    assert outputs["stop_str"].text == " "  # the stop string is cut from the text
    assert lifecycle.has_request("ignore") and not lifecycle.has_request("eos")


def test_min_tokens_holds_back_eos_and_the_context_length_always_stops(lifecycle, tokenizer):
    held, = add(lifecycle, tokenizer, "held", SamplingParams(max_tokens=10, min_tokens=2))
    assert feed(lifecycle, [held], [EOS]) == {}
    assert feed(lifecycle, [held], [EOS]) == {"held": RequestStatus.FINISHED_STOPPED}
    long, = add(lifecycle, tokenizer, "long", SamplingParams(max_tokens=None, ignore_eos=True),
                prompt=[5] * (MAX_MODEL_LEN - 2))
    assert long.max_tokens == 2
    assert feed(lifecycle, [long], [7]) == {}
    assert feed(lifecycle, [long], [7]) == {"long": RequestStatus.FINISHED_LENGTH}


def test_a_stop_string_wins_over_length_on_the_same_token(lifecycle, tokenizer):
    sequence, = add(lifecycle, tokenizer, "r", SamplingParams(max_tokens=1, stop=["stop"]))
    assert feed(lifecycle, [sequence], [word_id(tokenizer, " stop")]) == {
        "r": RequestStatus.FINISHED_STOPPED}
    [output] = lifecycle.make_outputs()
    assert output.outputs[0].stop_reason == "stop"


def test_n_children_fold_into_one_output_and_abort_returns_them(lifecycle, tokenizer):
    children = add(lifecycle, tokenizer, "p", SamplingParams(n=3, seed=5, max_tokens=4))
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [5, 6, 7]
    assert {lifecycle.parent_id(c.request_id) for c in children} == {"p"}
    assert feed(lifecycle, children[:2], [7, EOS]) == {"1_p": RequestStatus.FINISHED_STOPPED}
    [output] = lifecycle.make_outputs()
    assert output.request_id == "p" and not output.finished
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in output.outputs] == [None, "stop", None]
    # An abort names the sequences still running, for the scheduler to free.
    assert lifecycle.abort("p") == ["0_p", "2_p"]
    assert lifecycle.abort("p") == [] and lifecycle.abort("unknown") == []
    assert lifecycle.make_outputs() == [] and lifecycle.parents == {}


def test_a_request_is_output_once_finished_then_forgotten(lifecycle, tokenizer):
    sequence, = add(lifecycle, tokenizer, "r", SamplingParams(max_tokens=2))
    feed(lifecycle, [sequence], [7])
    assert [o.finished for o in lifecycle.make_outputs()] == [False]
    feed(lifecycle, [sequence], [8])
    [last] = lifecycle.make_outputs()
    assert last.finished and last.outputs[0].token_ids == [7, 8]
    assert lifecycle.parents == {} and lifecycle.children == {}
