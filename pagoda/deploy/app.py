"""The importable application builder: `serve run pagoda.deploy.app:build_app model=PATH
min_replicas=2 ...`, or a serve config (deploy/serve_config.yaml: `import_path:
pagoda.deploy.app:build_app` with `args:`). Each key of args is a `pagoda serve` flag without
its dashes (`_` or `-` alike); a list value repeats the flag, true gives a bare switch, false
or null leaves it out. The flags go through `pagoda serve`'s own parser and checks, so a bad
one fails the deploy with the message `pagoda serve` would print.
"""

from __future__ import annotations

import argparse
import contextlib
import io

from ray.serve import Application

from pagoda.deploy.application import application
from pagoda.deploy.options import add_serve_args, check_serve_args
from pagoda.entrypoints.openai.api_server import build_server_state

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""--log-level, accepted as `pagoda serve` accepts it (a replica logs at INFO regardless)."""


def serve_argv(args: dict) -> list[str]:
    """`pagoda serve` argv for a dict of flags (see the module docstring)."""
    argv = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def serve_parser() -> argparse.ArgumentParser:
    """`pagoda serve`'s flags (options.add_serve_args, as cli/serve.py adds them)."""
    parser = argparse.ArgumentParser(prog="pagoda serve")
    add_serve_args(parser)
    parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
    return parser


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`pagoda serve`'s parser and checks over argv; ValueError on a bad flag or value."""
    parser = serve_parser()
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            args = parser.parse_args(argv)
    except SystemExit:
        usage_error = message.getvalue().strip().splitlines()[-1:] or ["bad flags"]
        raise ValueError(f"pagoda serve {' '.join(argv)}: {usage_error[0]}") from None
    args.ray_serve = True
    check_serve_args(args)
    return args


def build_app(args: dict) -> Application:
    """The application for a dict of `pagoda serve` flags (see the module docstring)."""
    return application(parse_serve_args(serve_argv(dict(args))), build_server_state)
