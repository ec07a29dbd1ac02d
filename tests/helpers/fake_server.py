"""The tests' one fake OpenAI-compatible SSE server (no model): FakeServer runs it under
uvicorn in a thread; FakeServerProcess in a process of its own, which can be killed and
started again on the same port (`python -m tests.helpers.fake_server --port P --delay D`).

What it does is steered by markers in the prompt (the last user message for chat):
    [[500]]        HTTP 500 with an OpenAI error body
    [[drop]]       two chunks, then the connection is cut mid-stream
    [[hang]]       one chunk, then nothing (for --timeout)
    [[nodone]]     all chunks and usage, but no `data: [DONE]`
    [[error]]      one chunk, then an error event
otherwise it streams `max_tokens` one-word chunks, `delay` seconds apart, then usage. With
`unique_replies` the words name the request (" r{n}w{i}", n counting requests from 0), so
that every reply differs; `spans` holds (body, start, end) of each finished stream
(time.monotonic(): start when its body begins, end just before its last piece is sent).

GET /metrics exists only when `metrics_texts` is given: it answers them in order, the last
one for every later call (e.g. spec-decode counters before and after a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tests.helpers.ports import free_port

MODEL = "fake-model"


def build_app(delay: float = 0.0, metrics_texts: list[str] | None = None,
              unique_replies: bool = False) -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    app.state.spans = []
    app.state.in_flight = 0
    app.state.max_in_flight = 0
    app.state.metrics_scrapes = 0

    if metrics_texts:
        @app.get("/metrics")
        async def metrics():
            index = min(app.state.metrics_scrapes, len(metrics_texts) - 1)
            app.state.metrics_scrapes += 1
            return PlainTextResponse(metrics_texts[index])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        number = len(app.state.requests)
        app.state.requests.append(body)
        word = f" r{number}w" if unique_replies else " w"
        if chat:
            prompt = body["messages"][-1]["content"]
        else:
            prompt = body["prompt"]
        if "[[500]]" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}},
                                status_code=500)
        num_tokens = body.get("max_tokens", 16)
        prompt_tokens = len(prompt.split())

        def chunk(text: str, finish: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return "data: " + json.dumps({"choices": [choice], "usage": None}) + "\n\n"

        async def stream():
            app.state.in_flight += 1
            app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
            start = end = time.monotonic()
            try:
                async for piece in tokens():
                    end = time.monotonic()  # before the client can have this piece
                    yield piece
            finally:
                app.state.in_flight -= 1
                app.state.spans.append((body, start, end))

        async def tokens():
            for i in range(num_tokens):
                if i and delay:
                    await asyncio.sleep(delay)
                yield chunk(f"{word}{i}", "length" if i == num_tokens - 1 else None)
                if "[[drop]]" in prompt and i == 1:
                    raise RuntimeError("connection cut on purpose")
                if "[[hang]]" in prompt:
                    await asyncio.sleep(3600)
                if "[[error]]" in prompt:
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    return
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                     "total_tokens": prompt_tokens + num_tokens}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            if "[[nodone]]" not in prompt:
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    def __init__(self, delay: float = 0.0, metrics_texts: list[str] | None = None,
                 unique_replies: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(delay, metrics_texts, unique_replies)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="critical")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def requests(self) -> list[dict]:
        return self.app.state.requests

    def __enter__(self) -> FakeServer:  # noqa: PYI034 (no subclasses)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # do not wait for [[hang]] streams
        self.thread.join(10)


class FakeServerProcess:
    """build_app(delay) in a process of its own on a fixed port: killable, restartable."""

    def __init__(self, port: int, delay: float) -> None:
        self.port, self.delay = port, delay
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fake_server", "--port", str(self.port),
             "--delay", str(self.delay)], cwd=Path(__file__).parents[2])
        deadline = time.time() + 30
        while True:
            try:
                httpx.get(self.url + "/v1/models", timeout=1)
                return
            except httpx.HTTPError:
                assert time.time() < deadline and self.process.poll() is None
                time.sleep(0.05)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    options = parser.parse_args()
    uvicorn.run(build_app(options.delay), host="127.0.0.1", port=options.port,
                log_level="critical")
