"""`pagoda serve`: the OpenAI-compatible server, on uvicorn or (--ray-serve) on Ray Serve.

This module only parses: the flags are the server's (entrypoints/openai/server_args.py),
Ray Serve's and the engine's (all three added by deploy/options.add_serve_args, which
deploy/app.py parses with too); the server is assembled and run by
entrypoints/openai/api_server.py (its docstring tells the lifecycle), or deployed by
deploy/launch.py.
"""

from __future__ import annotations

import argparse

from pagoda.deploy.options import add_serve_args, check_serve_args


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.api_server import (
        build_server_state,
        model_configs,
        run_api_server,
    )
    from pagoda.entrypoints.openai.lora_args import check_lora_args

    check_serve_args(args)
    if getattr(args, "ray_serve", False):
        from pagoda.deploy.launch import run_ray_serve

        check_lora_args(args, model_configs(args))  # here, not first in every replica
        return run_ray_serve(args, build_server_state)
    return run_api_server(args)
