"""Config dataclasses -> CLI options and keyword arguments, with no second list to keep in step.

A config is a dataclass whose fields are either *options* (int, float, str, bool, or `X | None`
of one of those) or *sections* (another such dataclass). Each option is described where it is
declared:

    dtype: str = field(default="auto", metadata={"choices": SUPPORTED_DTYPES})
    '''Run dtype of weights and activations.'''      <- the attribute docstring: help text

  - the docstring below the field (read from the source with `ast`) is the help text;
  - the dataclass default is the CLI default;
  - `field(metadata=...)` may add `choices` (checked by argparse before any config is built)
    and `aliases` (more option strings; for a bool, an alias starting with `--no-` sets False);
  - a bool becomes `--name/--no-name` (argparse.BooleanOptionalAction).

Invariants (checked when the options are first read, so a bad field fails at once): option
names are unique across all sections, which makes the field `max_num_seqs`, the keyword
`max_num_seqs=` and the flag `--max-num-seqs` one name; every option has a docstring.
Validation of values stays in the dataclasses' `__post_init__`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any

SCALAR_TYPES = (int, float, str, bool)
DEFAULT_SUFFIX = " (default: %(default)s)"


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One option field of a config: where it lives and how the CLI spells it."""

    name: str
    section: tuple[str, ...]
    """Field names from the root config down to the dataclass that holds the option."""
    value_type: type
    """int, float, str or bool: the type without `| None`."""
    optional: bool
    """The annotation allows None."""
    default: Any
    help: str
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """{field name: docstring} for each `name: type = ...` followed by a string literal in the
    class body (and in its dataclass bases; the subclass wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
        for stmt, following in itertools.pairwise(body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


@functools.cache
def config_options(cls: type) -> tuple[ConfigOption, ...]:
    """Every option of `cls` and of its sections, depth first in field order."""
    options = tuple(_collect_options(cls, ()))
    seen: dict[str, ConfigOption] = {}
    for option in options:
        other = seen.setdefault(option.name, option)
        assert other is option, (
            f"option name {option.name!r} is in both {'.'.join(other.section) or cls.__name__} "
            f"and {'.'.join(option.section) or cls.__name__}; names must be unique"
        )
    return options


def _collect_options(cls: type, section: tuple[str, ...]):
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    for f in dataclasses.fields(cls):
        if not f.init:  # derived from the options in __post_init__, not one itself
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _collect_options(hint, (*section, f.name))
            continue
        value_type, optional = _unwrap_optional(hint)
        if value_type not in SCALAR_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: cannot make a CLI option of {hint!r}")
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} needs a docstring: it is the option's help")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        yield ConfigOption(
            name=f.name, section=section, value_type=value_type, optional=optional,
            default=default, help=docs[f.name], choices=f.metadata.get("choices"),
            aliases=tuple(f.metadata.get("aliases", ())),
        )


def _unwrap_optional(hint) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, title: str, description: str | None = None,
    repeatable: tuple[str, ...] = (),
) -> argparse._ArgumentGroup:
    """Add one argument group `title` with a `--field-name` option per option of `cls`; the
    options named in `repeatable` may be given more than once (a list, or None)."""
    group = parser.add_argument_group(title, description)
    for option in config_options(cls):
        _add_option(group, option, option.name in repeatable)
    return group


def _add_option(group: argparse._ArgumentGroup, option: ConfigOption, repeatable: bool) -> None:
    help_text = option.help.replace("%", "%%")
    if option.default is not None:
        help_text += DEFAULT_SUFFIX
    if option.value_type is bool:
        negative = [a for a in option.aliases if a.startswith("--no-")]
        positive = [a for a in option.aliases if not a.startswith("--no-")]
        action = group.add_argument(
            option.flag, *positive, dest=option.name, default=option.default,
            action=argparse.BooleanOptionalAction,
        )
        for alias in negative:  # BooleanOptionalAction would turn it into --no-no-...
            group.add_argument(alias, dest=option.name, action="store_false",
                               default=argparse.SUPPRESS, help=f"same as --no-{option.flag[2:]}")
    else:
        action = group.add_argument(
            option.flag, *option.aliases, dest=option.name, default=option.default,
            type=option.value_type, choices=option.choices,
            action="append" if repeatable else "store",
        )
        if repeatable:
            help_text += "; may be given more than once"
    action.help = help_text  # set after: BooleanOptionalAction may append its own default


def config_from_kwargs(cls: type, kwargs: Mapping[str, Any]):
    """Build `cls` (sections included) from flat option keywords; the others keep defaults.
    TypeError for a keyword that is no option, naming it and listing the valid ones."""
    options = {option.name: option for option in config_options(cls)}
    unknown = [key for key in kwargs if key not in options]
    if unknown:
        raise TypeError(
            f"unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; the engine options are: {', '.join(sorted(options))}"
        )
    for key, value in kwargs.items():
        check_option_type(options[key], value)
    return _build(cls, kwargs)


def check_option_type(option: ConfigOption, value: Any) -> None:
    """TypeError naming the option when `value` is not of its type (an int passes for a
    float; None only where the option allows it). The CLI's values arrive typed by argparse;
    this is for Python callers (LLM(max_num_seqs="8"))."""
    accepted = (int, float) if option.value_type is float else (option.value_type,)
    if (option.optional and value is None) or type(value) in accepted:
        return
    expected = option.value_type.__name__ + (" or None" if option.optional else "")
    raise TypeError(f"{option.name} must be {expected}, got {type(value).__name__} {value!r}")


def option_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{option name: value} of the options of `cls` that `args` holds (as parsed with
    add_config_args): the keywords config_from_kwargs takes."""
    return {option.name: getattr(args, option.name)
            for option in config_options(cls) if hasattr(args, option.name)}


def config_from_namespace(cls: type, args: argparse.Namespace):
    """Build `cls` from parsed arguments; options the namespace lacks keep their defaults."""
    return _build(cls, option_values(cls, args))


def _build(cls: type, values: Mapping[str, Any]):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
