"""--speculative-config / LLM(speculative_config=...): vLLM's JSON keys, parsed and checked
once at the edge."""

from __future__ import annotations

import re

import pytest

from pagoda.config import EngineConfig
from pagoda.speculative_config import SpeculativeConfig, parse_speculative_config
from tests.entrypoints.test_cli import assert_one_line_error, run_cli


def test_ngram_defaults_follow_vllm():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert spec == SpeculativeConfig("ngram", 4, None, 5, 5, True)
    spec = parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 4)
    spec = parse_speculative_config({"model": "draft.gguf", "num_speculative_tokens": 2})
    assert spec.method == "draft_model" and spec.model == "draft.gguf"


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, '"model" is for method'),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown keys ['lookahead']"),
])
def test_bad_configs_name_the_problem(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_speculative_config(value)


def test_the_engine_config_carries_the_parsed_form():
    config = EngineConfig.from_kwargs(speculative_config='{"num_speculative_tokens": 2}')
    assert config.speculative.num_speculative_tokens == 2
    assert EngineConfig().speculative is None


def test_the_cli_refuses_a_bad_config_in_one_line():
    assert_one_line_error(run_cli("generate", "--speculative-config", "{bad", "hi"),
                          "speculative_config is not valid JSON")
