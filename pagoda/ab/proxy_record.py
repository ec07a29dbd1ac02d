"""The A/B proxy's record: each side of each request timed from its bytes, one JSON line per
(side, request), and `read_proxy_record` to turn a record file into an A/B result.

The file (`pagoda ab-proxy --record FILE`, appended to, one line per object):

```
{"kind": "ab-proxy", "primary": URL, "candidate": URL, "mode": "mirror"|"split", "split": F|null,
 "started_at": unix seconds}                                  <- one header per proxy start
{"endpoint": "primary"|"candidate", "key": 17, "repeat": 0, "path": "/v1/completions",
 "greedy": true, "output_text": "..."|null, ...every field of RequestRecord.to_json()}
```
`key` is the proxy's request counter: a mirrored request's two lines share it. `start` is
seconds after that proxy started; `ttft`, `itl`, `latency` are seconds after the proxy sent that
side's request. Token counts are the server's `usage` (present when the user asked for it:
the proxy never changes a request). `error_kind` is client.py's ('http', 'connection',
'dropped', 'timeout', 'protocol') or 'shed' (a shadow not sent: --max-shadow-in-flight were
already running) or 'cancelled' (the user left before the end).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

from pagoda.bench import BenchError
from pagoda.bench.metrics import RequestRecord

logger = logging.getLogger(__name__)

HEADER_KIND = "ab-proxy"
SIDES = ("primary", "candidate")
MAX_KEPT_BODY_BYTES = 8 << 20
"""A non-streamed answer (or an error body) is copied up to this size to read its usage."""


class ResponseTimer:
    """One side's answer, timed from a copy of the bytes as they pass (never holding them back):
    feed() every raw chunk as it arrives, then finish() once. Fills `record`; `text` is the
    first choice's output (kept only with `keep_text`)."""

    def __init__(self, record: RequestRecord, chat: bool, keep_text: bool) -> None:
        self.record = record
        self.chat = chat
        self.keep_text = keep_text
        self.t0 = time.perf_counter()
        self.mode = "body"  # "sse": parse lines; "body": keep a copy; "opaque": compressed
        self.pending = b""
        self.kept: list[bytes] = []
        self.kept_bytes = 0
        self.pieces: list[str] = []
        self.done = False
        self.finished = False

    @property
    def text(self) -> str | None:
        return "".join(self.pieces) if self.keep_text else None

    def headers(self, status: int, content_type: str, content_encoding: str) -> None:
        self.record.http_status = status
        if content_encoding not in ("", "identity"):
            self.mode = "opaque"
        elif status < 400 and content_type.startswith("text/event-stream"):
            self.mode = "sse"

    def feed(self, data: bytes) -> None:
        if self.mode == "sse":
            now = time.perf_counter() - self.t0
            lines = (self.pending + data).split(b"\n")
            self.pending = lines.pop()
            for line in lines:
                # Events that came in one read share its arrival time (as the bench client's).
                if line.startswith(b"data:") and not self.done and self._event(line[5:].strip()):
                    self.record.chunk_times.append(now)
        elif self.mode == "body" and self.kept_bytes < MAX_KEPT_BODY_BYTES:
            self.kept.append(data)
            self.kept_bytes += len(data)

    def _event(self, data: bytes) -> bool:
        """One `data:` payload; True if it carried output text."""
        record = self.record
        if data == b"[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(data)
        except ValueError:
            record.error, record.error_kind = f"bad JSON in the stream: {data[:80]!r}", "protocol"
            return False
        if not isinstance(chunk, dict):
            return False
        if chunk.get("error") and record.error is None:
            record.error, record.error_kind = f"error event: {chunk['error']}"[:300], "protocol"
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens")
        got_text = False
        for choice in chunk.get("choices") or []:
            if self.chat:
                delta = choice.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            else:
                text = choice.get("text") or ""
            if text:
                got_text = True
                if self.keep_text and choice.get("index", 0) == 0:
                    self.pieces.append(text)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        return got_text

    def finish(self, error: str | None = None, error_kind: str | None = None) -> None:
        """The answer ended (error None) or failed; idempotent."""
        if self.finished:
            return
        self.finished = True
        record = self.record
        record.latency = time.perf_counter() - self.t0
        if error is not None:
            record.error, record.error_kind = error, error_kind
        elif record.error is not None:
            pass  # an error event or bad JSON in the stream
        elif record.http_status is not None and record.http_status >= 400:
            body = b"".join(self.kept).decode("utf-8", errors="replace").strip()
            record.error, record.error_kind = f"HTTP {record.http_status}: {body[:200]}", "http"
        elif self.mode == "sse" and not self.done:
            record.error = "stream ended without data: [DONE]"
            record.error_kind = "protocol"
        elif self.mode == "body":
            self._whole_answer(b"".join(self.kept))
        record.success = record.error is None

    def _whole_answer(self, body: bytes) -> None:
        """A non-streamed answer: its usage, finish reason and text (no TTFT: no chunks)."""
        try:
            answer = json.loads(body)
        except ValueError:
            return  # not JSON (or over MAX_KEPT_BODY_BYTES): only the status and latency count
        if not isinstance(answer, dict):
            return
        usage = answer.get("usage")
        if isinstance(usage, dict):
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.output_tokens = usage.get("completion_tokens")
        choices = answer.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        self.record.finish_reason = first.get("finish_reason")
        if self.keep_text:
            message = first.get("message") or {}
            self.pieces = [(message.get("content") or "") if self.chat else (first.get("text") or "")]


def record_line(side: str, key: int, path: str, greedy: bool, timer: ResponseTimer) -> dict:
    """One line of the record: the "requests" shape of an A/B result."""
    line = {"endpoint": side, "key": key, "repeat": 0, "path": path, "greedy": greedy,
            "output_text": timer.text if greedy else None}
    line.update(timer.record.to_json())
    return line


class RecordWriter:
    """Appends JSON lines to the record from a thread of its own, so the event loop never waits
    on the disk: write() only appends to a deque; every FLUSH_INTERVAL_S the thread writes
    what has come, whole lines, and flushes (one system call per batch, none per line). More
    than MAX_PENDING lines waiting are dropped (counted); a write error stops recording with
    one warning. Opening the file raises OSError (a bad --record is a usage error)."""

    MAX_PENDING = 10000
    FLUSH_INTERVAL_S = 0.2

    def __init__(self, path: str, header: dict) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.pending: collections.deque[dict] = collections.deque([header])
        self.num_written = 0
        self.num_dropped = 0
        self.disabled = False
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ab-proxy-record", daemon=True)
        self.thread.start()

    def write(self, line: dict) -> None:
        if self.disabled:
            return
        if len(self.pending) >= self.MAX_PENDING:
            self.num_dropped += 1
        else:
            self.pending.append(line)

    def _run(self) -> None:
        while True:
            closing = self.closing.wait(self.FLUSH_INTERVAL_S)
            lines = [self.pending.popleft() for _ in range(len(self.pending))]
            if lines and not self.disabled:
                try:
                    self.file.write("".join(json.dumps(line) + "\n" for line in lines))
                    self.file.flush()
                    self.num_written += len(lines)
                except (OSError, ValueError) as e:
                    self.disabled = True
                    logger.warning("--record %s: cannot write (%s); recording stops",
                                   self.path, e)
            if closing:
                return

    def close(self) -> None:
        """Write what is pending, stop the thread, close the file."""
        self.closing.set()
        self.thread.join(10)
        try:
            self.file.close()
        except OSError as e:
            if not self.disabled:
                logger.warning("--record %s: cannot close (%s)", self.path, e)


def read_proxy_record(path: str) -> dict:
    """A record of `pagoda ab-proxy` as an A/B result (the dict `pagoda bench ab` analyzes):
    endpoints "primary" and "candidate", every request line, and each side's duration (its
    first request's start to its last one's end, seconds). A file appended to by several
    proxy starts is read as one run: keys are renumbered so they stay unique, and starts are
    shifted to the first start's clock. Raises BenchError naming the file and line."""
    requests: list[dict] = []
    header: dict | None = None
    num_sessions, key_offset, next_key, time_offset = 0, 0, 0, 0.0
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise BenchError(f"{path}: cannot read it ({e.strerror})") from None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except ValueError:
            if number == len(lines):  # a last line cut short by a killed proxy
                logger.warning("%s:%d: incomplete last line skipped", path, number)
                continue
            raise BenchError(f"{path}:{number}: not a JSON line") from None
        if isinstance(item, dict) and item.get("kind") == HEADER_KIND:
            if header is None:
                header = item
            elif (item.get("primary"), item.get("candidate")) != (header.get("primary"),
                                                                  header.get("candidate")):
                raise BenchError(f"{path}:{number}: this proxy start has other URLs than the "
                                 "first; keep one primary/candidate pair per record file")
            num_sessions += 1
            key_offset = next_key
            time_offset = float(item.get("started_at", 0.0)) - float(header.get("started_at", 0.0))
            continue
        if (not isinstance(item, dict) or item.get("endpoint") not in SIDES
                or not isinstance(item.get("key"), int) or header is None):
            raise BenchError(f"{path}:{number}: not a line of an ab-proxy record (expected a "
                             "header, then {\"endpoint\": \"primary\"|\"candidate\", \"key\": ...})")
        item["key"] += key_offset
        item["start"] = float(item.get("start") or 0.0) + time_offset
        next_key = max(next_key, item["key"] + 1)
        requests.append(item)
    if header is None:
        raise BenchError(f"{path}: not a record of `pagoda ab-proxy` (no header line)")
    return {
        "kind": "ab", "engine": "pagoda-ab-proxy",
        "config": {"source": "ab-proxy", "record": path, "mode": header.get("mode"),
                   "split": header.get("split"), "proxy_starts": num_sessions},
        "endpoints": [{"name": side, "url": header.get(side), "label": None, "hardware": None,
                       "cost_per_hour": None} for side in SIDES],
        "requests": requests,
        "duration": {side: _side_duration([r for r in requests if r["endpoint"] == side])
                     for side in SIDES},
    }


def _side_duration(requests: list[dict]) -> float:
    """Seconds from the first request's start to the last one's end (0.0 for none)."""
    if not requests:
        return 0.0
    first = min(r["start"] for r in requests)
    last = max(r["start"] + (r.get("latency") or 0.0) for r in requests)
    return last - first
