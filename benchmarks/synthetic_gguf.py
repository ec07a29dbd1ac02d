"""Random-weight GGUF files with the shapes of the models people deploy.

Speed depends on shapes, not values: a Llama-3.2-1B-shaped file with random weights costs what
the real model costs per token. The files carry the bundled model's tokenizer (SmolLM2's BPE,
49152 tokens), so every engine can tokenize the prompts `pagoda bench` sends; the vocabulary,
and with it the embedding and output-head shapes, is therefore 49152 wide rather than the
real model's (128256 for Llama 3, 151936 for Qwen2.5). The weights are written as llama.cpp's
convert_hf_to_gguf.py writes them (its tensor names and metadata keys) in float16, ready for
llama.cpp's own `llama-quantize` (benchmarks/PEERS.md), so that both engines read the very
same quantized file.

    .venv/bin/python benchmarks/synthetic_gguf.py llama-3.2-1b /tmp/models/llama-1b-f16.gguf
    .venv/bin/python benchmarks/synthetic_gguf.py --list

Not modelled (no effect on the cost per token): Llama 3's rope-frequency scaling tensor
(`rope_freqs`), chat templates. Writing is streamed one tensor at a time: peak memory is one
float32 tensor (the embedding, 49152 x hidden), whatever the model's size. The writer itself is
the project's one GGUF writer, pagoda/executor/loader/gguf_writer.py (random weights:
gguf_random_model.py); this is its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pagoda.executor.loader.gguf_random_model import (
    OUTTYPES,
    SHAPES,
    Shape,
    parameter_count,
    write_random_model,
)

__all__ = ["SHAPES", "Shape", "bundled_model", "main", "parameter_count", "write"]


def write(name: str, shape: Shape, path: str, tokenizer_source: str, outtype: str = "f16",
          seed: int = 0) -> None:
    """Writes the random-weight model `name` with `shape` to `path` (see the module text)."""
    write_random_model(name, shape, path, tokenizer_source, outtype, seed)


def bundled_model() -> str:
    from pagoda.executor.loader.model_files import bundled_model_path

    return bundled_model_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", nargs="?", choices=sorted(SHAPES), help="the shapes to write")
    parser.add_argument("output", nargs="?", help="the .gguf file to write")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f16",
                        help="the 2-D weights' type (K-quants: llama-quantize this file)")
    parser.add_argument("--layers", type=int, help="override the layer count (a quick file)")
    parser.add_argument("--context", type=int,
                        help="override the context length written (a long-context run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", default=None,
                        help="a GGUF file whose tokenizer to copy (default: the bundled model)")
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        vocab = 49152
        for name, shape in SHAPES.items():
            count = parameter_count(shape, vocab) / 1e9
            print(f"{name:14s} {count:5.2f}B parameters (vocab {vocab})  {shape}")
        return 0
    if not args.model or not args.output:
        parser.error("give a model (one of --list) and an output path")
    shape = SHAPES[args.model]
    if args.layers is not None:
        if args.layers < 1:
            parser.error("--layers must be at least 1")
        shape = dataclasses.replace(shape, layers=args.layers)
    if args.context is not None:
        if args.context < 1:
            parser.error("--context must be at least 1")
        shape = dataclasses.replace(shape, context=args.context)
    write(args.model, shape, args.output, args.tokenizer_from or bundled_model(),
          args.outtype, args.seed)
    print(f"wrote {args.output}: {args.model}, {shape.layers} layers, context "
          f"{shape.context}, {args.outtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
