"""The measurements behind `--dtype auto` on a CPU: each activation dtype's speed in each
phase (prefill, 1-stream decode, batched decode) and its fidelity to float32, on one model,
in one process, so the ratios come from the same minutes.

    .venv/bin/python benchmarks/dtype_by_phase.py                      # the bundled model
    .venv/bin/python benchmarks/dtype_by_phase.py --model FILE.gguf --prompt-tokens 512

Every mode runs the file's own packed types (what `auto` quantization runs). Prefill: one
prompt of --prompt-tokens tokens, one output token (an idle engine's TTFT, offline). Decode:
--decode-tokens greedy tokens for 1 and for --batch prompts (output tokens / s, prefill
excluded by subtracting a 1-token run of the same prompts), and the greedy answer to the
README's question. Fidelity over many positions: benchmarks/fidelity_report.py.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagoda import LLM, SamplingParams
from pagoda.executor.kernels.cpu_info import cpu_features, cpu_name

QUESTION = "What is the capital of France?"


def seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str | None, dtype: str, args) -> dict:
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=args.batch)
    vocab = llm.get_tokenizer().vocab_size
    torch.manual_seed(0)
    long_prompt = torch.randint(100, min(vocab, 30000), (args.prompt_tokens,)).tolist()
    short = [torch.randint(100, min(vocab, 30000), (16,)).tolist() for _ in range(args.batch)]
    seconds(llm, [long_prompt[:64]], 4)  # warm-up
    prefill = min(seconds(llm, [long_prompt], 1) for _ in range(args.repeats))
    result = {"prefill_tok_s": args.prompt_tokens / prefill, "ttft_s": prefill}
    for streams in (1, args.batch):
        prompts = short[:streams]
        base = min(seconds(llm, prompts, 1) for _ in range(args.repeats))
        full = min(seconds(llm, prompts, args.decode_tokens + 1) for _ in range(args.repeats))
        result[f"decode_{streams}_tok_s"] = streams * args.decode_tokens / (full - base)
    answer = llm.chat([{"role": "user", "content": QUESTION}],
                      SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    result["answer"] = answer.strip().replace("\n", " ")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()} ({' '.join(cpu_features())}), {torch.get_num_threads()} threads")
    results = {}
    for dtype in args.dtypes:
        results[dtype] = measure(args.model, dtype, args)
    print(f"{'dtype':<10} {'prefill tok/s':>13} {'TTFT s':>7} {'1-stream tok/s':>14} "
          f"{args.batch:>3}-stream tok/s  answer")
    for dtype, r in results.items():
        print(f"{dtype:<10} {r['prefill_tok_s']:>13.1f} {r['ttft_s']:>7.2f} "
              f"{r['decode_1_tok_s']:>14.1f} {r[f'decode_{args.batch}_tok_s']:>16.1f}  "
              f"{r['answer']!r}")


if __name__ == "__main__":
    main()
