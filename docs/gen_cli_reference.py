"""Writes docs/reference/cli.md, the command-line reference, from the `pagoda` parsers.

The reference is generated, never written by hand, so it cannot drift from `--help`:
tests/test_docs_site.py fails when the committed file differs from what this script
renders now. After changing a flag, regenerate it from the repository root:

    PYTHONPATH=. .venv/bin/python docs/gen_cli_reference.py

One section per command (`pagoda serve`, `pagoda bench ab`, ...) in the order the parser
declares them, one table per argument group, one row per flag: its spellings, its value,
its default and its help text with `%(default)s` expanded as `--help` shows it. Nothing in
the output depends on the machine or the terminal (no usage lines, whose wrapping follows
the terminal's width).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REGENERATE = "PYTHONPATH=. .venv/bin/python docs/gen_cli_reference.py"
OUTPUT = Path(__file__).resolve().parent / "reference" / "cli.md"

HEADER = f"""# Command line

<!-- Generated from the argparse parsers by docs/gen_cli_reference.py: do not edit.
     Regenerate with: {REGENERATE} -->

Every `pagoda` command and flag, generated from the parsers themselves (the same text as
`pagoda COMMAND --help`). `python -m pagoda ...` is the same command. The flags of the
engine (the `engine` group below) are also `LLM(...)` keywords of the same name, with `_`
for `-`. What the flags do, with examples, is in the manual; the
[server and engine flags](flags.md) page explains the main ones at more length.

Exit codes: 0 done; 1 the server's engine loop died; 2 a usage error (a bad flag, path or
value: one line `pagoda: error: ...` on stderr); 130 interrupted (Ctrl-C).
"""


def _escape(text: str) -> str:
    """Table-cell text: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        shown = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    elif action.metavar is not None:
        shown = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    else:
        shown = action.dest.upper()
    if action.nargs in ("+", "*"):
        shown += " ..."
    return f"`{shown}`"


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(default, (list, tuple)):
        return f"`{' '.join(str(item) for item in default)}`" if default else ""
    return f"`{default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    return _escape(parser._get_formatter()._expand_help(action))


def _flag_rows(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    rows = []
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help is argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
        rows.append(f"| {names} | {_value(action)} | {_default(action)} "
                    f"| {_help(parser, action)} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                found.append((name, subparser, helps.get(name, "")))
    return found


def _render_command(prog: str, parser: argparse.ArgumentParser, summary: str,
                    depth: int) -> list[str]:
    lines = [f"{'#' * depth} `{prog}`", ""]
    description = parser.description or summary
    if description:
        lines += [" ".join(description.split()), ""]
    children = _subcommands(parser)
    if children:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| `{prog} {name}` | {_escape(text)} |" for name, _, text in children]
        lines.append("")
    for group in parser._action_groups:
        rows = _flag_rows(parser, group._group_actions)
        if not rows:
            continue
        title = group.title or "options"
        lines += [f"**{title}**", "", "| flag | value | default | what it does |",
                  "|---|---|---|---|", *rows, ""]
    for name, child, text in children:
        lines += _render_command(f"{prog} {name}", child, text, depth + 1)
    return lines


def render() -> str:
    """The whole reference page, as Markdown."""
    from pagoda.cli.main import build_parser

    parser = build_parser()
    lines = [HEADER]
    lines += _render_command("pagoda", parser, "", 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
