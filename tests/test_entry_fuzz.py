"""Bad input on every Python and CLI entry gets a clear error, never a crash: hypothesis
throws generated values at SamplingParams, LLM() and the `pagoda` CLI's engine and sampling
flags. Each call either passes validation (LLM / the CLI then reach the engine builder, which
the tests stub out: nothing loads) or raises / prints one error that names the bad option."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
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
