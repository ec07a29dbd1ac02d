"""`pagoda bench soak`: a long mixed load that checks the server loses nothing and leaks nothing.

The workload (seeded, `soak_workload`) mixes completions, chat and responses (the Responses
API: a share of the chat requests without stop strings), streaming and not, n > 1, stop
strings, logprobs, greedy and seeded sampling, short and long prompts, and two client fates
besides waiting for the answer: `disconnect` (a stream closed after its first chunks) and
`cancel` (a request given up before its answer). Greedy requests draw from a few templates
whose answers are first taken alone, one at a time (`references`); under load every greedy
choice must equal its template's reference. Half the sampled chat requests are shaped as
client libraries send them (soak_shapes.py: a forced tool call, a JSON schema), checked
whole. One request in eight is an embedding
(POST /v1/embeddings, one of EMBEDDING_INPUTS): its vector, taken alone first too, must
come back under load in the same direction (cosine >= EMBEDDING_MIN_COSINE: batching may
change float rounding, nothing more); `--no-embeddings` leaves them out (a server without
/v1/embeddings).

    references (alone) -> warm-up requests -> the rest -> drain -> final /metrics
                 RSS sampled from /metrics all along (process_resident_memory_bytes)

Checks (`SoakReport.problems`): every request ended (done, aborted by us, or a clean error:
an HTTP error with an OpenAI body or an SSE error event), none hung; every greedy choice
equals its reference; after the drain no request runs, waits or is tracked and no KV block is
held; RSS after the drain is within `max_rss_growth` of RSS after the warm-up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from pagoda.bench import BenchError
from pagoda.bench.client import ENDPOINT_PATHS
from pagoda.bench.soak_shapes import SHAPES, shape_problem
from pagoda.bench.soak_workload import (
    SHORT_PROMPTS,
    SoakRequest,
    embedding_inputs,
    greedy_templates,
    soak_workload,
)

PATHS = {**ENDPOINT_PATHS, "responses": "/v1/responses", "embeddings": "/v1/embeddings"}
EMBEDDING_MIN_COSINE = 0.999
METRICS = ("num_requests_running", "num_requests_waiting", "num_requests_tracked",
           "num_kv_blocks_held", "num_preemptions_total")


@dataclass
class Outcome:
    """How one request ended: "done", "aborted" (our disconnect or cancel), "error" (a clean
    HTTP error or SSE error event), "broken" (no clean end: a dropped connection, bad
    JSON, a stream without [DONE]) or "hung" (no answer within the timeout)."""

    index: int
    status: str
    texts: dict[int, str] = field(default_factory=dict)
    """Choice index -> its whole text (done requests)."""
    vector: list[float] | None = None
    """An embedding request's vector (done)."""
    shape_problems: list[str] = field(default_factory=list)
    """A shaped request's choices that broke their shape (soak_shapes.py; done)."""
    detail: str = ""
    """What went wrong (error, broken, hung)."""


def _error_detail(status: int, body: str) -> tuple[str, str]:
    """("error", message) for an OpenAI error body, else ("broken", what came)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "broken", f"HTTP {status} without an OpenAI error body: {body[:120]!r}"
    return "error", f"HTTP {status}: {message}"


def _choice_text(choice: dict, endpoint: str, stream: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    message = choice.get("delta" if stream else "message") or {}
    return message.get("content") or ""


async def run_request(client: httpx.AsyncClient, base_url: str, request: SoakRequest,
                      model: str | None, timeout: float) -> Outcome:
    payload = request.payload()
    if model is not None:
        payload["model"] = model
    url = base_url + PATHS[request.endpoint]
    call = _stream(client, url, payload, request) if request.stream else \
        _whole(client, url, payload, request)
    cancel = request.fate == "cancel"
    try:
        return await asyncio.wait_for(call, request.cancel_after if cancel else timeout)
    except asyncio.TimeoutError:
        if cancel:
            return Outcome(request.index, "aborted")  # the connection is closed: a disconnect
        return Outcome(request.index, "hung", detail=f"no answer within {timeout:.0f}s")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        # a dropped connection, or a body that is not the OpenAI shape (bad JSON included)
        return Outcome(request.index, "broken", detail=f"{type(e).__name__}: {e}")


async def _whole(client, url, payload, request: SoakRequest) -> Outcome:
    response = await client.post(url, json=payload)
    if response.status_code != 200:
        status, detail = _error_detail(response.status_code, response.text)
        return Outcome(request.index, status, detail=detail)
    body = response.json()
    if request.endpoint == "embeddings":
        [data] = body["data"]
        return Outcome(request.index, "done", vector=[float(x) for x in data["embedding"]])
    if request.endpoint == "responses":
        return Outcome(request.index, "done", {0: "".join(
            part["text"] for item in body["output"] if item["type"] == "message"
            for part in item["content"] if part["type"] == "output_text")})
    texts = {c["index"]: _choice_text(c, request.endpoint, False) for c in body["choices"]}
    problems = [] if request.shape is None else [
        problem for c in body["choices"] if (problem := shape_problem(request.shape, c))]
    return Outcome(request.index, "done", texts, shape_problems=problems)


async def _stream(client, url, payload, request: SoakRequest) -> Outcome:
    texts: dict[int, str] = {}
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            status, detail = _error_detail(response.status_code, (await response.aread()).decode())
            return Outcome(request.index, status, detail=detail)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return Outcome(request.index, "done", texts)
            chunk = json.loads(data)
            if request.endpoint == "responses":
                ended = _responses_event(chunk, texts)
                if ended is not None:
                    return Outcome(request.index, ended[0], texts, detail=ended[1])
            elif "error" in chunk:
                return Outcome(request.index, "error", detail=chunk["error"]["message"])
            else:
                for choice in chunk["choices"]:
                    index = choice["index"]
                    texts[index] = texts.get(index, "") + _choice_text(choice, request.endpoint,
                                                                       True)
            if request.fate == "disconnect":
                return Outcome(request.index, "aborted")  # closes the connection mid-stream
    return Outcome(request.index, "broken", detail="the stream ended without its last event")


def _responses_event(event: dict, texts: dict[int, str]) -> tuple[str, str] | None:
    """A Responses stream event: its text into texts[0]; (status, detail) when it is the
    last one (response.completed / .incomplete: done; response.failed, error: an error)."""
    kind = event["type"]
    if kind == "response.output_text.delta":
        texts[0] = texts.get(0, "") + event["delta"]
    elif kind in ("response.completed", "response.incomplete"):
        return "done", ""
    elif kind in ("response.failed", "error"):
        return "error", (event.get("response", {}).get("error") or event)["message"]
    return None


async def read_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """Pagoda's gauges and counters of METRICS, and the process RSS, from /metrics."""
    values = {}
    for line in (await client.get(base_url + "/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        short = name.removeprefix("pagoda:")
        if short in METRICS or name == "process_resident_memory_bytes":
            values[short] = values.get(short, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


@dataclass
class SoakReport:
    num_requests: int
    duration_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    """Details of "error", "broken" and "hung" outcomes, counted."""
    num_greedy_checked: int = 0
    greedy_mismatches: list[dict] = field(default_factory=list)
    num_embeddings_checked: int = 0
    embedding_mismatches: list[dict] = field(default_factory=list)
    """Embeddings whose cosine with their reference fell below EMBEDDING_MIN_COSINE."""
    num_shaped_checked: int = 0
    shape_mismatches: list[dict] = field(default_factory=list)
    """Forced tool calls and JSON-schema answers that broke their shape."""
    num_preemptions: float = 0.0
    after_drain: dict[str, float] = field(default_factory=dict)
    rss_samples: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the start, requests finished, RSS bytes)."""
    rss_after_warmup: float = 0.0
    rss_after_drain: float = 0.0
    max_rss_growth: float = 0.05

    @property
    def rss_growth(self) -> float:
        return self.rss_after_drain / self.rss_after_warmup - 1 if self.rss_after_warmup else 0.0

    def problems(self) -> list[str]:
        found = []
        for status in ("broken", "hung"):
            if self.outcomes.get(status):
                found.append(f"{self.outcomes[status]} request(s) {status}")
        if self.greedy_mismatches:
            found.append(f"{len(self.greedy_mismatches)} greedy choice(s) differ from their "
                         "reference")
        if self.shape_mismatches:
            found.append(f"{len(self.shape_mismatches)} tool-call or JSON answer(s) broke "
                         "their shape")
        if self.embedding_mismatches:
            found.append(f"{len(self.embedding_mismatches)} embedding(s) differ from their "
                         "reference")
        for name in ("num_requests_running", "num_requests_waiting", "num_requests_tracked",
                     "num_kv_blocks_held"):
            if self.after_drain.get(name, 0) != 0:
                found.append(f"{name} is {self.after_drain[name]:g} after the drain")
        if self.rss_growth >= self.max_rss_growth:
            found.append(f"RSS grew {self.rss_growth:.1%} after the warm-up "
                         f"(limit {self.max_rss_growth:.0%})")
        return found

    def to_json(self) -> dict:
        return {**asdict(self), "rss_growth": self.rss_growth, "problems": self.problems()}


async def run_soak(base_url: str, num_requests: int, concurrency: int = 16, seed: int = 0,
                   model: str | None = None, api_key: str | None = None,
                   timeout: float = 300.0, warmup_fraction: float = 0.2,
                   sample_every: float = 2.0, max_rss_growth: float = 0.05,
                   progress=None, embeddings: bool = True) -> SoakReport:
    """Run the soak against `base_url`; `progress(done, total)` is called as requests end.
    `embeddings`: mix in embedding requests (the server serves /v1/embeddings)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    report = SoakReport(num_requests, max_rss_growth=max_rss_growth)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        templates = greedy_templates(seed)
        references = {}
        for template in templates:  # alone, one at a time
            outcome = await run_request(client, base_url, template, model, timeout)
            if outcome.status != "done":
                raise BenchError(f"the reference request of template {template.template} "
                                   f"failed: {outcome.status} {outcome.detail}")
            references[template.template] = outcome.texts[0]
        vectors = {}
        for text in embedding_inputs(seed) if embeddings else []:  # alone, one at a time
            reference = SoakRequest(index=-1, endpoint="embeddings", prompt=text, max_tokens=0,
                                    stream=False)
            outcome = await run_request(client, base_url, reference, model, timeout)
            if outcome.status != "done":
                raise BenchError(f"the reference embedding of {text[:40]!r} failed: "
                                 f"{outcome.status} {outcome.detail} (--no-embeddings leaves "
                                 "embeddings out)")
            vectors[text] = outcome.vector
        for shape in SHAPES:  # once alone: the grammar engine's first use is not a leak
            shaped = SoakRequest(index=-1, endpoint="chat", prompt=SHORT_PROMPTS[0],
                                 max_tokens=32, stream=False, shape=shape)
            outcome = await run_request(client, base_url, shaped, model, timeout)
            if outcome.status != "done" or outcome.shape_problems:
                raise BenchError(f"the first {shape!r} request failed: {outcome.status} "
                                 f"{outcome.detail}{'; '.join(outcome.shape_problems)}")
        workload = soak_workload(num_requests, seed, templates, embeddings)
        start_metrics = await read_metrics(client, base_url)
        start = time.perf_counter()
        finished: list[Outcome] = []
        warmup_count = max(1, int(num_requests * warmup_fraction))
        semaphore = asyncio.Semaphore(concurrency)

        async def one(request: SoakRequest) -> None:
            async with semaphore:
                finished.append(await run_request(client, base_url, request, model, timeout))
            if progress is not None:
                progress(len(finished), num_requests)

        async def sample_rss() -> None:
            while True:
                metrics = await read_metrics(client, base_url)
                rss = metrics.get("process_resident_memory_bytes", 0.0)
                report.rss_samples.append((time.perf_counter() - start, len(finished), rss))
                if len(finished) >= warmup_count and not report.rss_after_warmup:
                    report.rss_after_warmup = rss
                await asyncio.sleep(sample_every)

        sampler = asyncio.create_task(sample_rss())
        try:
            await asyncio.gather(*(one(request) for request in workload))
        finally:
            sampler.cancel()
        report.after_drain = await _drained_metrics(client, base_url)
        report.duration_s = time.perf_counter() - start
    report.rss_after_drain = report.after_drain.get("process_resident_memory_bytes", 0.0)
    report.rss_samples.append((report.duration_s, len(finished), report.rss_after_drain))
    report.num_preemptions = (report.after_drain.get("num_preemptions_total", 0.0)
                              - start_metrics.get("num_preemptions_total", 0.0))
    _tally(report, finished, workload, references)
    _check_embeddings(report, finished, workload, vectors)
    return report


async def _drained_metrics(client: httpx.AsyncClient, base_url: str,
                           wait_s: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (aborts reach the engine a moment after the
    client goes), or after `wait_s` seconds."""
    deadline = time.perf_counter() + wait_s
    while True:
        metrics = await read_metrics(client, base_url)
        busy = metrics.get("num_requests_running", 0) + metrics.get("num_requests_waiting", 0)
        if (not busy and not metrics.get("num_requests_tracked", 0)) \
                or time.perf_counter() > deadline:
            return metrics
        await asyncio.sleep(0.2)


def _tally(report: SoakReport, finished: list[Outcome], workload: list[SoakRequest],
           references: dict[int, str]) -> None:
    report.outcomes = dict(Counter(o.status for o in finished))
    report.errors = dict(Counter(o.detail[:160] for o in finished if o.detail))
    for outcome in finished:
        request = workload[outcome.index]
        if outcome.status == "done" and request.shape is not None:
            report.num_shaped_checked += 1
            report.shape_mismatches += [{"request": outcome.index, "shape": request.shape,
                                         "problem": p} for p in outcome.shape_problems]
        if outcome.status != "done" or request.template is None:
            continue
        reference = references[request.template]
        for choice, text in sorted(outcome.texts.items()):
            report.num_greedy_checked += 1
            if text != reference:
                report.greedy_mismatches.append({
                    "request": outcome.index, "choice": choice, "template": request.template,
                    "stream": request.stream, "got": text[:200], "reference": reference[:200]})


def _check_embeddings(report: SoakReport, finished: list[Outcome], workload: list[SoakRequest],
                      vectors: dict[str, list[float]]) -> None:
    for outcome in finished:
        request = workload[outcome.index]
        if outcome.status != "done" or request.endpoint != "embeddings":
            continue
        report.num_embeddings_checked += 1
        got, reference = np.asarray(outcome.vector), np.asarray(vectors[request.prompt])
        cosine = float(got @ reference / (np.linalg.norm(got) * np.linalg.norm(reference)))
        if got.shape != reference.shape or not cosine >= EMBEDDING_MIN_COSINE:
            report.embedding_mismatches.append({
                "request": outcome.index, "input": request.prompt[:80], "cosine": cosine})


def plot_rss(report: SoakReport, path: str) -> None:
    """RSS (MiB) over the run, the warm-up's end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t / 60 for t, _, _ in report.rss_samples]
    rss = [r / 2**20 for _, _, r in report.rss_samples]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot(times, rss, label="server RSS")
    if report.rss_after_warmup:
        axis.axhline(report.rss_after_warmup / 2**20, color="gray", linestyle=":",
                     label="after warm-up")
        axis.axhline(report.rss_after_warmup * (1 + report.max_rss_growth) / 2**20,
                     color="red", linestyle="--", label=f"+{report.max_rss_growth:.0%} limit")
    axis.set_xlabel("minutes")
    axis.set_ylabel("MiB")
    axis.set_title(f"pagoda bench soak: {report.num_requests} requests, "
                   f"RSS growth {report.rss_growth:+.1%}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
