"""Fidelity of Pagoda's modes against the float32 run of the same weights, on the texts of
tests/data/fidelity/, in llama-perplexity's way or over every position.

    .venv/bin/python benchmarks/fidelity_report.py                       # every position
    .venv/bin/python benchmarks/fidelity_report.py --llama-windows 512   # as llama-perplexity

--llama-windows N concatenates the texts in the order llama.cpp reads them (sorted file
names), cuts the token stream into N-token windows and scores the second half of each: the
positions `llama-perplexity -c N --kl-divergence` scores (benchmarks/PEERS.md), so both
engines' figures compare. Modes are dtype:quantization[:kv_cache_dtype] (the KV cache's
storage, `--kv-cache-dtype`; auto when left out): `float32:none:int8` is float32 with an
int8 KV cache. Quantized modes run every matmul through the small-batch kernels that decode
steps take (large batches otherwise multiply by exactly dequantized weights, which is
float32's own result in float32).

    .venv/bin/python benchmarks/fidelity_report.py --modes float32:none:int8 \
        float32:none:fp8_e4m3 float32:none:fp8_e5m2                     # the KV cache alone
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pagoda.evaluation.fidelity import (
    build_runner,
    compare_teacher_forced,
    context_windows,
    decode_kernels_only,
    next_token_logits,
)
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.tokenizer import load_tokenizer

TEXTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "fidelity"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+",
                        default=["float32:int4", "float32:int8", "bfloat16:none"])
    parser.add_argument("--llama-windows", type=int, default=None, metavar="N_CTX")
    parser.add_argument("--max-tokens-per-text", type=int, default=1100)
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model_files(None))
    files = sorted(TEXTS.glob("*.txt"))
    if args.llama_windows:
        stream = tokenizer.encode("".join(f.read_text() for f in files))
        texts = context_windows(stream, args.llama_windows)
        score_from, max_len = args.llama_windows // 2, args.llama_windows
    else:
        texts = [tokenizer.encode(f.read_text())[: args.max_tokens_per_text] for f in files]
        score_from, max_len = 0, max(map(len, texts))
    reference = build_runner(torch.float32, None, max_len=max_len)
    reference_logits = [next_token_logits(reference, ids) for ids in texts]
    del reference
    print(f"{len(texts)} texts, scored from position {score_from}")
    for mode in args.modes:
        dtype, quantization, kv_cache_dtype = (mode.split(":") + ["auto"])[:3]
        candidate = build_runner(DTYPES[dtype], None if quantization == "none" else quantization,
                                 max_len=max_len, kv_cache_dtype=kv_cache_dtype)
        with decode_kernels_only(candidate):
            report = compare_teacher_forced(reference_logits, candidate, texts, score_from)
        print(f"{mode:>16}  {report.summary()}", flush=True)


if __name__ == "__main__":
    main()
