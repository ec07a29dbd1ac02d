"""Plain Hugging Face transformers `generate()` on the workload of `pagoda bench throughput`.

Static batches: prompts are taken `--batch-size` at a time, left-padded, and each batch runs
to the end before the next starts (no continuous batching, no paged KV cache). float32, greedy,
every request forced to exactly --output-len new tokens (min_new_tokens = max_new_tokens), on
the same random token-id prompts as `pagoda bench throughput` (same tokenizer, same seed).
The bundled GGUF is dequantized by transformers (gguf_file=); needs `accelerate`.

Writes the same JSON shape as `pagoda bench throughput --output`, so that
`pagoda bench compare transformers.json pagoda.json` works:

    .venv/bin/python benchmarks/transformers_baseline.py --num-prompts 32 \
        --input-len 128 --output-len 128 --batch-size 32 --output /tmp/transformers.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

from pagoda.bench import offline, report
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per static batch")
    p.add_argument("--output", default=None, help="write the result JSON here")
    p.add_argument("--label", default="transformers", help="name in `bench compare`")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    files = resolve_model_files(args.model)
    if files.format != "gguf":
        print("transformers_baseline: --model must be a GGUF file", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(files)
    prompts = offline.random_prompts(tokenizer, args.num_prompts, args.input_len,
                                     args.range_ratio, args.seed)
    folder, name = os.path.split(os.path.abspath(files.path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id

    def generate(batch: list[list[int]], num_tokens: int) -> int:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 do_sample=False, pad_token_id=pad_id)
        return (out.shape[1] - width) * len(batch)

    generate([prompts[0][:16]], 4)  # warm-up, untimed
    batch_sizes: dict[int, int] = {}
    num_output_tokens = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), args.batch_size), desc="Static batches", unit="batch"):
        batch = prompts[i:i + args.batch_size]
        num_output_tokens += generate(batch, args.output_len)
        # one prefill step and output_len - 1 decode steps, all at this batch size
        batch_sizes[len(batch)] = batch_sizes.get(len(batch), 0) + args.output_len
    elapsed = time.perf_counter() - start
    summary = offline.throughput_summary(
        len(prompts), sum(len(p) for p in prompts), num_output_tokens, elapsed, batch_sizes,
        sum(batch_sizes.values()),
    )
    print(offline.format_throughput(summary, f"transformers, static batches of {args.batch_size}"))
    if args.output:
        config = dict(vars(args), model_path=files.path, dtype="float32",
                      transformers=__import__("transformers").__version__)
        result = report.envelope("throughput", "transformers", config)
        result["label"] = args.label
        result["summary"] = summary
        report.write_json(args.output, result)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
