"""`pagoda serve`'s LoRA flags (issue 35): --lora-modules values in both of vLLM's forms, and
every bad start-up adapter or flag a one-line error with exit code 2, before any engine is
built; `pagoda bench serve --lora-names` spreads requests round-robin from a seeded start."""

from __future__ import annotations

import json

import pytest

from pagoda.bench.metrics import RequestRecord, summarize
from pagoda.bench.report import format_serve_summary
from pagoda.bench.serve import spread_models
from pagoda.entrypoints.openai.lora_modules import check_unique_names, parse_lora_module
from pagoda.lora.lora_modules import LoRAModule
from tests.entrypoints.test_cli import assert_one_line_error, run_cli
from tests.lora.peft_adapters import base_model, make_adapter


def test_lora_modules_values() -> None:
    assert parse_lora_module("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert parse_lora_module("sql=/a=b") == LoRAModule("sql", "/a=b")
    assert parse_lora_module(json.dumps({"name": "sql", "path": "/a", "base_model_name": "m"})
                             ) == LoRAModule("sql", "/a", "m")
    for bad, fragment in [("sql", "name=path"), ("=/a", "name=path"), ("sql=", "name=path"),
                          ('{"name": "sql"', "not valid JSON"),
                          ('{"name": "sql", "path": "/a", "rank": 8}', "unknown key"),
                          ('{"name": "", "path": "/a"}', "non-empty")]:
        with pytest.raises(ValueError, match=fragment):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="given twice"):
        check_unique_names([LoRAModule("a", "/1"), LoRAModule("a", "/2")], ["m"])
    with pytest.raises(ValueError, match="name of a served model"):
        check_unique_names([LoRAModule("m", "/1")], ["m"])


def test_spread_models_is_round_robin_from_a_seeded_start() -> None:
    names = ["a", "b", "c"]
    spread = spread_models(7, names, seed=0)
    assert sorted(spread.count(n) for n in names) == [2, 2, 3]
    assert all(spread[i + 1] == names[(names.index(spread[i]) + 1) % 3] for i in range(6))
    assert spread_models(7, names, seed=0) == spread
    assert {spread_models(3, names, seed)[0] for seed in range(20)} == set(names)
    records = [RequestRecord(index=i, success=i != 1, output_tokens=4, model=m)
               for i, m in enumerate(["a", "b", "a"])]
    summary = summarize(records, 1.0)
    assert summary["requests_by_model"] == {
        "a": {"requests": 2, "completed": 2, "output_tokens": 8},
        "b": {"requests": 1, "completed": 0, "output_tokens": 0}}
    assert "model b:" in format_serve_summary(summary, "run")
    assert "requests_by_model" not in summarize([RequestRecord(index=0)], 1.0)


@pytest.mark.slow
def test_bad_start_up_adapters_are_one_line_errors(tmp_path) -> None:
    tiny = str(tmp_path / "tiny")
    make_adapter(tiny, base_model())  # shapes of the tiny test model, not the bundled one's
    assert_one_line_error(run_cli("serve", "--lora-modules", f"x={tiny}"),
                          "--lora-modules x", "--enable-lora")
    assert_one_line_error(run_cli("serve", "--enable-lora", "--lora-modules", f"x={tiny}"),
                          "--lora-modules", "'x'", "base model's is 576 -> ")
    assert_one_line_error(run_cli("serve", "--enable-lora", "--lora-modules",
                                  f"x={tmp_path / 'none'}"), "--lora-modules", "'x'", "none")
    assert_one_line_error(run_cli("serve", "--enable-lora", "--lora-modules", "x"),
                          "--lora-modules 'x'", "name=path")
    assert_one_line_error(run_cli("serve", "--enable-lora", "--lora-modules",
                                  json.dumps({"name": "x", "path": tiny,
                                              "base_model_name": "other"})),
                          "base_model_name 'other' is not a served model")
    assert_one_line_error(run_cli("serve", "--enable-lora", "--lora-allowed-paths",
                                  str(tmp_path / "nowhere")),
                          "--lora-allowed-paths", "no such directory")
