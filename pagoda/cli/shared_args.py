"""Options several subcommands share: the engine's (one flag per field of pagoda/config.py's
dataclasses) and the sampling options of `generate` and `chat`."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.config import EngineConfig
from pagoda.config_args import attribute_docstrings, option_values
from pagoda.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser, repeatable: tuple[str, ...] = ()) -> None:
    """The "engine" group: `--model`, `--dtype`, `--max-num-seqs`, ... (see pagoda/config.py);
    the options named in `repeatable` may be given more than once (a list)."""
    EngineConfig.add_cli_args(parser, repeatable)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe; ValueError for a bad value."""
    return EngineConfig.from_cli_args(args)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as `LLM(**kwargs)` keywords."""
    return option_values(EngineConfig, args)


def check_model(args: argparse.Namespace) -> None:
    """A --model that names no model fails here, in a fraction of a second, not after the
    engine's imports (torch and transformers: ~2 s); ModelLoadError, a one-line error."""
    from pagoda.executor.loader.model_files import resolve_model_files

    resolve_model_files(args.model)


SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
"""The sampling flags of `generate` and `chat`, with the CLI's defaults (greedy, 256 tokens)."""


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """`--max-tokens`, `--temperature`, `--top-p`, `--top-k`; help from SamplingParams."""
    docs = attribute_docstrings(SamplingParams)
    group = parser.add_argument_group("sampling")
    for name, default in SAMPLING_DEFAULTS.items():
        group.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                           help=docs[name].replace("%", "%%") + " (default: %(default)s)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams of the sampling flags; ValueError for a bad value."""
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_DEFAULTS})
