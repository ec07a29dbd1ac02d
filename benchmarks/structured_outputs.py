"""What structured outputs cost a running server: the issue-16 goals.

    .venv/bin/pagoda serve --port 8000 &        # any OpenAI-compatible server
    .venv/bin/python benchmarks/structured_outputs.py --base-url http://127.0.0.1:8000 \
        --output result.json

1. Throughput: 16 concurrent requests of 128 output tokens each, all unconstrained
   (`ignore_eos`), against the same with half of them under a JSON schema (an array that
   cannot be complete within 128 tokens, so every request still runs 128 tokens). Output
   tokens per second of each run; the runs alternate, `--rounds` times each.
2. Time to first token, one request at a time (streamed): an unconstrained request against
   one with a schema of 20 properties never seen before (new property names each time, so
   the grammar is compiled, not served from the cache), `--ttft-requests` of each,
   interleaved; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import httpx

LONG_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 400}


def new_schema() -> dict:
    tag = uuid.uuid4().hex[:6]
    names = [f"{tag}_{i}" for i in range(20)]
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: {"type": ["string", "integer", "boolean"][i % 3]}
                           for i, n in enumerate(names)}}


def body(model: str, prompt: str, max_tokens: int, schema: dict | None, stream: bool) -> dict:
    request = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if schema is None:
        request["ignore_eos"] = True
    else:
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "out", "schema": schema}}
    return request


async def throughput(client: httpx.AsyncClient, model: str, constrained: bool) -> float:
    async def one(i: int) -> int:
        schema = LONG_ARRAY if constrained and i % 2 == 0 else None
        response = await client.post("/v1/chat/completions", json=body(
            model, f"List words about topic {i}.", 128, schema, False))
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(16)))
    return sum(tokens) / (time.perf_counter() - start)


async def ttft(client: httpx.AsyncClient, model: str, schema: dict | None) -> float:
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body(
            model, "Fill in the record.", 4, schema, True)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                return time.perf_counter() - start
    raise RuntimeError("no content streamed")


async def run(args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await throughput(client, model, True)  # warm-up (and the schema's compile)
        free, mixed = [], []
        for _ in range(args.rounds):
            free.append(await throughput(client, model, False))
            mixed.append(await throughput(client, model, True))
        plain, schema = [], []
        for _ in range(args.ttft_requests):
            plain.append(await ttft(client, model, None))
            schema.append(await ttft(client, model, new_schema()))
    return {
        "throughput_unconstrained_tok_s": free,
        "throughput_half_constrained_tok_s": mixed,
        "throughput_ratio": statistics.median(mixed) / statistics.median(free),
        "ttft_unconstrained_s": plain,
        "ttft_new_20_property_schema_s": schema,
        "ttft_added_ms": (statistics.median(schema) - statistics.median(plain)) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=9)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
