"""One config, one source of options: every config field is a CLI flag and an LLM keyword.

The flags come from pagoda/config_args.py reading the dataclasses in pagoda/config.py; these
tests check the mapping both ways and that a new field needs nothing but its declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from pagoda.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda.config_args import (
    DEFAULT_SUFFIX,
    add_config_args,
    attribute_docstrings,
    config_from_kwargs,
    config_from_namespace,
    config_options,
)

SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig)


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    EngineConfig.add_cli_args(parser)
    return parser


def option_fields():
    """(section class, field) for every option field, read from the dataclasses themselves
    (a field set in __post_init__, init=False, is derived: no option)."""
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if f.init and not (isinstance(f.type, str) and f.type.endswith("Config")):
                yield cls, f


def plain_help(action: argparse.Action) -> str:
    """The help as written in the docstring: without the default note and the %-escapes."""
    return action.help.removesuffix(DEFAULT_SUFFIX).replace("%%", "%")


def test_every_field_is_a_flag_whose_help_is_its_docstring() -> None:
    actions = engine_parser()._option_string_actions
    fields = list(option_fields())
    assert len(fields) == 26  # a sanity floor: the sections were really walked
    for cls, f in fields:
        flag = "--" + f.name.replace("_", "-")
        assert flag in actions, f"{cls.__name__}.{f.name} has no {flag}"
        action = actions[flag]
        assert action.dest == f.name
        docstring = attribute_docstrings(cls)[f.name]
        assert docstring and plain_help(action) == docstring


def test_a_derived_field_is_no_option_but_is_declared() -> None:
    """EngineConfig.speculative (speculative_config parsed) is a declared field, not a hidden
    attribute, and no flag."""
    assert "--speculative" not in engine_parser()._option_string_actions
    config = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", '
                                                         '"num_speculative_tokens": 3}')
    assert "speculative" in {f.name for f in dataclasses.fields(config)}
    assert config.speculative.num_speculative_tokens == 3
    assert EngineConfig().speculative is None


def test_help_texts_keep_the_richer_wording() -> None:
    actions = engine_parser()._option_string_actions
    assert "int4 (Q4_1's form" in actions["--quantization"].help
    assert "bundled" in actions["--model"].help
    assert actions["--dtype"].choices == ("auto", "float32", "bfloat16", "float16")
    assert actions["--scheduling-policy"].choices == ("fcfs", "priority")
    assert "none" in actions["--quantization"].choices


def test_parsed_defaults_are_the_default_config() -> None:
    assert EngineConfig.from_cli_args(engine_parser().parse_args([])) == EngineConfig()


def test_flags_round_trip_into_their_sections() -> None:
    args = engine_parser().parse_args([
        "--model", "m.gguf", "--dtype", "float32", "--quantization", "none", "--compile",
        "--max-model-len", "512", "--tokenizer", "tok", "--seed", "7",
        "--block-size", "32", "--kv-cache-memory", "1000", "--gpu-memory-utilization", "0.5",
        "--no-prefix-caching", "--num-kv-blocks", "12",
        "--max-num-batched-tokens", "4096", "--max-num-seqs", "4",
        "--scheduling-policy", "priority", "--no-enable-chunked-prefill", "--device", "cpu",
    ])
    config = EngineConfig.from_cli_args(args)
    assert config == EngineConfig(
        model=ModelConfig(model="m.gguf", dtype="float32", quantization="none", compile=True,
                          max_model_len=512, tokenizer="tok", seed=7),
        cache=CacheConfig(block_size=32, kv_cache_memory=1000, gpu_memory_utilization=0.5,
                          enable_prefix_caching=False, num_kv_blocks=12),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=4,
                                  scheduling_policy="priority", enable_chunked_prefill=False),
        device="cpu",
    )


@pytest.mark.parametrize("argv, expected", [
    ([], True),
    (["--no-prefix-caching"], False),
    (["--no-enable-prefix-caching"], False),
    (["--no-prefix-caching", "--enable-prefix-caching"], True),
])
def test_prefix_caching_flag_and_its_alias(argv, expected) -> None:
    config = EngineConfig.from_cli_args(engine_parser().parse_args(argv))
    assert config.cache.enable_prefix_caching is expected


def test_argparse_refuses_a_value_outside_the_choices(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_parser().parse_args(["--dtype", "float8"])
    assert exit_info.value.code == 2
    assert "float8" in capsys.readouterr().err


def test_a_bad_value_fails_in_the_dataclass() -> None:
    args = engine_parser().parse_args(["--block-size", "3"])
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig.from_cli_args(args)


def test_from_kwargs_builds_the_nested_config() -> None:
    config = EngineConfig.from_kwargs(model="x.gguf", max_num_seqs=3, num_kv_blocks=9,
                                      device="cpu")
    assert config.model.model == "x.gguf"
    assert config.scheduler.max_num_seqs == 3
    assert config.cache.num_kv_blocks == 9
    assert config.device == "cpu"
    assert config.model.dtype == ModelConfig().dtype  # untouched fields keep their defaults
    assert EngineConfig.from_kwargs() == EngineConfig()


def test_from_kwargs_names_an_unknown_keyword_and_lists_the_valid_ones() -> None:
    with pytest.raises(TypeError) as error:
        EngineConfig.from_kwargs(max_num_seqs=3, num_gpu_blocks_override=5)
    message = str(error.value)
    assert "'num_gpu_blocks_override'" in message
    assert "max_num_seqs" in message and "num_kv_blocks" in message


def test_option_names_are_unique_across_sections() -> None:
    names = [option.name for option in config_options(EngineConfig)]
    assert len(names) == len(set(names)) == 39


# ---- the mechanism on a config of its own: a flag is added in one place -------------------------


@dataclass(frozen=True)
class ToyInner:
    depth: int = 3
    """How deep the toy goes."""
    label: str | None = None
    """A name for it, or none."""


@dataclass(frozen=True)
class ToyConfig:
    inner: ToyInner = field(default_factory=ToyInner)
    fast: bool = False
    """Go fast, at 100% speed."""
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    """The mode,
    in two lines."""
    ratio: float = field(default=0.5, metadata={"aliases": ("-r",)})
    """A ratio."""


def toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy")
    add_config_args(parser, ToyConfig, "toy")
    return parser


def test_a_new_dataclass_field_is_a_flag_and_a_keyword() -> None:
    parser = toy_parser()
    actions = parser._option_string_actions
    assert {"--depth", "--label", "--fast", "--no-fast", "--mode", "--ratio", "-r"} <= set(actions)
    assert plain_help(actions["--depth"]) == "How deep the toy goes."
    assert plain_help(actions["--fast"]) == "Go fast, at 100% speed."
    assert plain_help(actions["--mode"]) == "The mode,\nin two lines."
    assert actions["--mode"].choices == ("a", "b")
    assert "100% speed" in parser.format_help()  # the % is escaped for argparse

    args = parser.parse_args(["--depth", "5", "--label", "x", "--fast", "--mode", "b", "-r", "2"])
    assert config_from_namespace(ToyConfig, args) == ToyConfig(
        inner=ToyInner(depth=5, label="x"), fast=True, mode="b", ratio=2.0)
    assert config_from_namespace(ToyConfig, parser.parse_args([])) == ToyConfig()
    assert config_from_kwargs(ToyConfig, {"depth": 1}) == ToyConfig(inner=ToyInner(depth=1))


@dataclass(frozen=True)
class Undocumented:
    size: int = 1


@dataclass(frozen=True)
class Clashing:
    inner: ToyInner = field(default_factory=ToyInner)
    depth: int = 2
    """Also a depth."""


@dataclass(frozen=True)
class Unmappable:
    sizes: list[int] = field(default_factory=list)
    """Sizes."""


def test_a_field_without_docstring_or_with_an_unmappable_type_fails_loudly() -> None:
    with pytest.raises(TypeError, match="needs a docstring"):
        config_options(Undocumented)
    with pytest.raises(TypeError, match="cannot make a CLI option"):
        config_options(Unmappable)
    with pytest.raises(AssertionError, match="'depth'"):
        config_options(Clashing)
