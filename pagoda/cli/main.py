"""`pagoda generate | chat | serve | bench | env | ab-proxy`: the parser and the exit codes.

Exit codes: 0 done; 1 the server's engine loop died; 2 a usage error: a bad flag (argparse)
or a ValueError/OSError a user can cause (a bad path, a bad value; ModelLoadError,
InvalidRequestError and BenchError are ValueErrors), printed as one line `pagoda: error: ...`
on stderr, without a traceback; 130 interrupted (Ctrl-C).

Each subcommand lives in its own module with a `register(subparsers)` function; add a
subcommand by adding a module and one line to SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagoda.cli import ab_proxy, bench, chat, env, generate, serve
from pagoda.executor.models.supported import describe_supported

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
SUBCOMMANDS = (generate, chat, serve, bench, env, ab_proxy)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="Pagoda LLM inference engine",
        epilog=f"Models (--model):\n{describe_supported()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS,
                        help="level of the engine's log on stderr (default: %(default)s)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(subparsers)
    _add_log_level_to_subcommands(parser)
    return parser


def _add_log_level_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """--log-level after a subcommand too (`pagoda serve --log-level INFO`), at any depth
    (`pagoda bench serve ...`). SUPPRESS: a subcommand that is not given it leaves the value
    set before the subcommand (or the default) alone."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.add_argument("--log-level", default=argparse.SUPPRESS,
                                       choices=LOG_LEVELS,
                                       help="level of the engine's log on stderr")
                _add_log_level_to_subcommands(subparser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    for token in argv:
        # argparse drops a value of exactly "--" (its end-of-options marker): `--dtype=--`
        # would reach the engine as dtype [] (CPython's argparse before 3.12)
        if token.startswith("-") and token.endswith("=--"):
            parser.error(f"argument {token[:-3]}: expected one argument, not '--'")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
