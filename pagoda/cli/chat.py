"""`pagoda chat`: an interactive multi-turn chat with the model (/reset, /exit)."""

from __future__ import annotations

import argparse
import sys

from pagoda.cli.shared_args import (
    add_engine_args,
    add_sampling_args,
    check_model,
    engine_kwargs,
    sampling_params,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="interactive multi-turn chat (/reset, /exit)")
    parser.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run_chat)


class ChatSession:
    """The REPL's conversation: the history sent with each turn, cleared by /reset."""

    def __init__(self, llm, params, system: str | None = None) -> None:
        self.llm, self.params = llm, params
        self.base = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, str]] = list(self.base)

    def send(self, text: str) -> str:
        self.history.append({"role": "user", "content": text})
        reply = self.llm.chat(self.history, self.params, use_tqdm=False)[0].outputs[0].text
        self.history.append({"role": "assistant", "content": reply})
        return reply

    def reset(self) -> None:
        self.history = list(self.base)


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate before the slow imports and model load
    check_model(args)
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    try:
        return _chat_loop(ChatSession(llm, params, args.system))
    finally:
        if args.kv_offload_dir is not None:  # the conversation's KV blocks go to the disk tier
            llm.engine.shutdown()


def _chat_loop(session: ChatSession) -> int:
    print("Pagoda chat. /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            session.reset()
            print("(history cleared)", file=sys.stderr)
            continue
        print(session.send(text), flush=True)
