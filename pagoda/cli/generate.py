"""`pagoda generate PROMPT`: one chat-formatted answer from the model, printed to stdout."""

from __future__ import annotations

import argparse

from pagoda.cli.shared_args import (
    add_engine_args,
    add_sampling_args,
    check_model,
    engine_kwargs,
    sampling_params,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete one chat-formatted prompt and print it")
    parser.add_argument("prompt", help="the user message")
    add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate before the slow imports and model load
    check_model(args)
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    if args.kv_offload_dir is not None:  # the prompt's KV blocks go to the disk tier
        llm.engine.shutdown()
    return 0
