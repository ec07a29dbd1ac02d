"""`pagoda generate | chat | serve | bench | env`.

Errors a user can cause (a bad path, a bad value) print one line to stderr and exit with
code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagoda.config import QUANTIZATION_CHOICES, SUPPORTED_DTYPES

EXIT_USAGE = 2


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M)")
    group.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's")
    group.add_argument("--dtype", default="auto", choices=SUPPORTED_DTYPES)
    group.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                       help="weight-only quantized linear layers, CPU only (activations stay "
                            "in --dtype), in groups of 32: int4 (Q4_1's form; on a Q4_1 GGUF "
                            "model its own 4-bit weights) or int8 (Q8_0's form); the logits "
                            "head then runs int8. Default auto: int4 for a Q4_1 GGUF model "
                            "wherever Pagoda's CPU kernels build (float32, or bfloat16 with "
                            "AVX-512 BF16), else none; `pagoda env` shows the choice")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model and warm it up at start: faster decode "
                            "steps (1.1-1.5x on a 2-core CPU with int4, 1.3-1.6x in bf16), "
                            "but up to a minute of compiling per step shape first (3 shapes, "
                            "4 with quantized weights). Default: eager")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's context)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes for the KV cache on CPU (default: 256 MiB, or one "
                            "--max-model-len sequence if more; at most a fifth of free RAM)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn automatic prefix caching off")
    group.add_argument("--max-num-seqs", type=int, default=128, help="most requests in a batch")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one step")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    group.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model, "tokenizer": args.tokenizer, "dtype": args.dtype,
        "quantization": args.quantization, "compile": args.compile, "device": args.device,
        "max_model_len": args.max_model_len, "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory, "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduling_policy": args.scheduling_policy, "seed": args.seed,
    }


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def sampling_params(args: argparse.Namespace):
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    params = sampling_params(args)  # validate before the slow model load
    llm = LLM(**engine_kwargs(args))
    output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


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


def cmd_chat(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    params = sampling_params(args)
    session = ChatSession(LLM(**engine_kwargs(args)), params, args.system)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one chat-formatted prompt and print it")
    gen.add_argument("prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /exit)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from pagoda.entrypoints.serve_cli import add_serve_parser
    add_serve_parser(sub, add_engine_args)

    from pagoda.bench.cli import add_bench_parser
    add_bench_parser(sub, add_engine_args)

    from pagoda.entrypoints.env_cli import add_env_parser
    add_env_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        # Our user-facing errors are ValueError subclasses (ModelLoadError included).
        print(f"pagoda: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
