"""Where one batched decode step spends its time: torch.profiler over a few engine steps.

    .venv/bin/python benchmarks/profile_decode_step.py --batch 64 --dtype bfloat16
    .venv/bin/python benchmarks/profile_decode_step.py --batch 64 --quantization int8
    .venv/bin/python benchmarks/profile_decode_step.py --batch 16 --no-profiler --steps 30
    .venv/bin/python benchmarks/profile_decode_step.py --model FILE.gguf --batch 16 \
      --no-profiler --steps 8 [--decode-activations int16] [--no-amx-tiles]

Prefills `--batch` random 128-token prompts, then profiles `--steps` pure decode steps and
prints the mean step time and the top operators (grouped by input shape).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from torch.profiler import ProfilerActivity, profile

from pagoda import LLM, SamplingParams
from pagoda.config import QUANTIZATION_CHOICES
from pagoda.executor.kernels.arithmetic import set_amx_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model path (default: the bundled one)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--decode-activations", default="auto")
    parser.add_argument("--no-amx-tiles", action="store_true",
                        help="the vector kernel for every row count, whatever start-up chose")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0,
                        help="GiB of KV cache: a 1B model's batches of 128+ rows need ~4")
    parser.add_argument("--rows", type=int, default=14, help="operators to list")
    parser.add_argument("--no-profiler", action="store_true",
                        help="time the steps only (the profiler slows small ops down)")
    args = parser.parse_args()

    model = {"model": args.model} if args.model else {}
    llm = LLM(**model, dtype=args.dtype, quantization=args.quantization,
              decode_activations=args.decode_activations,
              kv_cache_memory=int(args.kv_cache_memory * (1 << 30)),
              max_model_len=2048, max_num_seqs=256)
    engine = llm.engine
    if args.no_amx_tiles:
        set_amx_rows({})
    params = SamplingParams(temperature=0, max_tokens=args.steps + 6, ignore_eos=True)
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(128)] for i in range(args.batch)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while True:  # prefill, until a step is pure decode: one token for each request
        engine.step()
        snapshot = engine.snapshot()
        if snapshot.last_step_num_tokens == snapshot.last_step_num_seqs == args.batch:
            break
    for _ in range(2):
        engine.step()  # first decode steps: warm caches
    profiler = (contextlib.nullcontext() if args.no_profiler
                else profile(activities=[ProfilerActivity.CPU], record_shapes=True))
    with profiler as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1000
    quant = f", {args.quantization}" if args.quantization else ""
    print(f"batch {args.batch}, {engine.dtype}{quant}: {step_ms:.1f} ms per decode step "
          f"({args.batch / step_ms * 1000:.0f} output tokens/s)")
    if not args.no_profiler:
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.rows
        ))


if __name__ == "__main__":
    main()
