"""Bad input on every Python and CLI entry gets a clear error, never a crash: hypothesis
throws generated values at SamplingParams, LLM() and the `pagoda` CLI's engine and sampling
flags. Each call either passes validation (LLM / the CLI then reach the engine builder, which
the tests stub out: nothing loads) or raises / prints one error that names the bad option."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagoda import SamplingParams
from pagoda.cli.main import EXIT_USAGE, main
from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig
from pagoda.config_args import config_options

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-5, 10**6), max_size=4), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.integers(-5, 10**6), st.floats(), max_size=3),
)
SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)
                   if f.name != "structured_outputs"]
ENGINE_OPTIONS = [option for cls in (ModelConfig, CacheConfig, SchedulerConfig)
                  for option in config_options(cls) if option.name != "model"]
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class ReachedTheEngine(Exception):
    """Raised by the stubbed engine builder: the arguments passed every check."""


@pytest.fixture
def no_engine(monkeypatch):
    def build_engine(config):
        raise ReachedTheEngine

    monkeypatch.setattr("pagoda.entrypoints.llm.build_engine", build_engine)


def names_one_of(message: str, names) -> bool:
    return any(name in message or name.replace("_", "-") in message for name in names)


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), ANY_VALUE, max_size=4))
def test_sampling_params_accept_or_name_the_bad_field(kwargs) -> None:
    try:
        SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        assert names_one_of(str(error), kwargs), (kwargs, error)


@FUZZ
@given(st.dictionaries(st.sampled_from([o.name for o in ENGINE_OPTIONS]), ANY_VALUE,
                       min_size=1, max_size=3))
def test_llm_keywords_pass_or_name_the_bad_one(no_engine, kwargs) -> None:
    from pagoda import LLM

    try:
        LLM(**kwargs)
    except ReachedTheEngine:
        pass
    except (ValueError, TypeError) as error:
        assert names_one_of(str(error), kwargs), (kwargs, error)


FLAG_VALUES = st.one_of(st.text(alphabet="-0123456789.eEinfatx ", max_size=8),
                        st.integers(-(2**40), 2**40).map(str), st.sampled_from(["", "nan", "-1"]))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([o.flag for o in ENGINE_OPTIONS]
                                          + ["--max-tokens", "--temperature", "--top-p",
                                             "--top-k"]),
                          FLAG_VALUES), min_size=1, max_size=3))
@example(flags=[("--dtype", "--")])  # argparse's end-of-options marker as a value (found so)
def test_cli_flags_run_or_fail_in_one_line(no_engine, capsys, flags) -> None:
    argv = ["generate", "Hi"]
    for flag, value in flags:
        argv += [f"{flag}={value}"]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse: a malformed value, a usage line
        assert exit_.code == EXIT_USAGE
        return
    except ReachedTheEngine:
        return
    finally:
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
    assert code == EXIT_USAGE
    errors = [line for line in captured.err.splitlines() if line.startswith("pagoda: error:")]
    assert len(errors) == 1, captured.err


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "role", "content", "text", "call_id", "name", "arguments",
                         "output", "schema", "format", "id", "parameters"]), inner, max_size=4),
    max_leaves=12)
RESPONSE_ITEMS = st.lists(st.one_of(
    JSON_VALUE,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                           "content": JSON_VALUE}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                    "reasoning", "message", "image"]),
                           "call_id": st.sampled_from(["c", 1]), "name": JSON_VALUE,
                           "arguments": st.sampled_from(["{}", "[1]", "x"]),
                           "output": JSON_VALUE}),
), max_size=4)


@FUZZ
@given(st.one_of(st.text(max_size=8), RESPONSE_ITEMS),
       st.dictionaries(st.sampled_from(["instructions", "tools", "tool_choice", "text",
                                        "max_output_tokens", "temperature", "include",
                                        "truncation", "store", "reasoning", "top_logprobs",
                                        "parallel_tool_calls", "metadata", "bogus"]),
                       JSON_VALUE, max_size=3))
def test_responses_requests_convert_or_name_the_bad_field(input_, fields) -> None:
    """POST /v1/responses' parsing and its conversion to chat (responses_api/): a request
    becomes a chat request, or its error names a field the request has."""
    import json

    from pydantic import ValidationError

    from pagoda.entrypoints.openai.protocol.errors import from_validation_error
    from pagoda.entrypoints.openai.responses_api.protocol import ResponsesRequest
    from pagoda.entrypoints.openai.responses_api.to_chat import chat_conversion, own_items
    from pagoda.errors import InvalidRequestError

    body = {"input": input_, **fields}
    try:
        request = ResponsesRequest.model_validate_json(json.dumps(body))
        for param, message in request.unsupported_fields():
            raise InvalidRequestError(message, param)
        items = own_items(request)
        chat_conversion(request, items, [f"input[{i}]" for i in range(len(items))])
        return
    except ValidationError as e:
        param = from_validation_error(e).param
    except InvalidRequestError as e:
        param = e.param
    assert param is not None and param.split(".")[0].split("[")[0] in body, (body, param)
