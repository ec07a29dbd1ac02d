"""llguidance vs xgrammar on the bundled model's tokenizer: what constrained decoding costs.

    .venv/bin/python benchmarks/grammar_engines.py [--output result.json]

Measures, for a JSON schema of 20 required properties: building the engine's token
structures once, compiling the schema, the first bitmask, and a bitmask in the middle of an
object. xgrammar is measured only if it imports (it depends on torch, triton and a TVM
runtime; Pagoda does not install it): install it in another venv with a tokenizer saved by
this script's `--save-tokenizer DIR` and run the script there with `--tokenizer DIR`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                   for i in range(20)},
    "required": [f"field_{i}" for i in range(20)],
    "additionalProperties": False,
}
PREFIX = '{"field_0": "abc", "field_1": 12'


def timed(fn, repeat: int = 5) -> float:
    """Median seconds of `fn()` over `repeat` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_llguidance(tokenizer, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - start

    def compile_schema():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        return llguidance.LLMatcher(ll_tokenizer, grammar)

    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def first_mask():
        llguidance.numpy.fill_next_token_bitmask(compile_schema(), bitmask, 0)

    matcher = compile_schema()
    for token_id in tokenizer.encode(PREFIX, add_special_tokens=False):
        assert matcher.consume_token(token_id)
    return {
        "tokenizer_setup_s": setup,
        "compile_s": timed(compile_schema),
        "compile_and_first_mask_s": timed(first_mask),
        "mask_mid_object_s": timed(
            lambda: llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0), 50),
    }


def bench_xgrammar(tokenizer, vocab_size: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile_schema():
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))

    matcher = compile_schema()
    for token_id in tokenizer.encode(PREFIX, add_special_tokens=False):
        assert matcher.accept_token(token_id)
    return {
        "tokenizer_setup_s": setup,
        "compile_s": timed(compile_schema),
        "compile_and_first_mask_s": timed(lambda: compile_schema().fill_next_token_bitmask(
            bitmask)),
        "mask_mid_object_s": timed(lambda: matcher.fill_next_token_bitmask(bitmask), 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None,
                        help="a saved tokenizer folder (default: the bundled model's)")
    parser.add_argument("--save-tokenizer", default=None, help="save the tokenizer here too")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from pagoda.executor.loader.model_files import bundled_model_path, resolve_model_files
        from pagoda.executor.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_files(bundled_model_path()))
    if args.save_tokenizer:
        tokenizer.save_pretrained(args.save_tokenizer)
    vocab_size = len(tokenizer)
    results = {}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            results[name] = bench(tokenizer, vocab_size)
        except ImportError as e:
            results[name] = {"skipped": f"not installed ({e})"}
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
