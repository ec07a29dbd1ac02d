"""The traffic record: one JSON object per line, one line per request, what `pagoda bench ab`
replays. `pagoda serve --record-traffic FILE` writes it (entrypoints/openai/traffic_recorder.py);
pagoda/ab/trace_import.py turns public traces into the same entries.

    {"arrival": 1.25, "endpoint": "chat", "body": {"messages": [...], "max_tokens": 64},
     "prompt_tokens": 31, "output_tokens": 64, "ttft": 0.021, "latency": 0.93,
     "status": 200, "source": "pagoda serve"}

Times are seconds; `arrival` counts from the trace's first request. A server writes a line when
its response ends, so lines are not in arrival order: `read_traffic` sorts them.

Redaction (`--record-redact`): `redact_body` replaces every text a user wrote (prompts, message
contents) with a placeholder of the same number of tokens under the model's tokenizer, so the
traffic keeps its shape (lengths, turns, every other field) and none of its words.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, Self


class TrafficRecordError(ValueError):
    """A traffic record that cannot be read: the message names the file and line (or the field
    of one entry). A ValueError, so the CLI prints it as one line and exits with code 2."""


ENDPOINTS = ("completions", "chat")
"""What TrafficEntry.endpoint may be: /v1/completions or /v1/chat/completions."""

PLACEHOLDER_WORD = "x"
"""Redacted text is this word repeated, space-separated: one token per repetition under the
usual tokenizers (checked by re-counting)."""


@dataclass
class TrafficEntry:
    """One request of a traffic record."""

    arrival: float
    """Seconds after the trace's first request arrived (the first entry: 0.0)."""
    endpoint: str
    """"completions" or "chat"."""
    body: dict
    """The request JSON as the client sent it (or redacted)."""
    prompt_tokens: int | None = None
    """The server's count (None: not known)."""
    output_tokens: int | None = None
    """The server's count (None: not known)."""
    ttft: float | None = None
    """Seconds from arrival to the first output chunk, server-side (streams only)."""
    latency: float | None = None
    """Seconds from arrival to the response's end, server-side."""
    status: int | None = None
    """The HTTP status the server answered."""
    source: str | None = None
    """A free label: "pagoda serve", "sharegpt", "azure-trace", "mooncake", ..."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> TrafficEntry:
        """The entry of one decoded line; TrafficRecordError naming the field that is wrong
        (without the file: read_traffic adds it). Keys it does not know are ignored (records from newer
        versions still read)."""
        if not isinstance(data, dict):
            raise TrafficRecordError(f"expected a JSON object, got {type(data).__name__}")
        for key in ("arrival", "endpoint", "body"):
            if key not in data:
                raise TrafficRecordError(f"missing '{key}'")
        arrival = data["arrival"]
        if not _is_number(arrival) or not math.isfinite(arrival) or arrival < 0:
            raise TrafficRecordError(
                f"'arrival' must be a number of seconds >= 0, got {arrival!r}")
        if data["endpoint"] not in ENDPOINTS:
            raise TrafficRecordError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, "
                                     f"got {data['endpoint']!r}")
        if not isinstance(data["body"], dict):
            raise TrafficRecordError("'body' must be a JSON object (the request)")
        for key in ("prompt_tokens", "output_tokens", "status"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise TrafficRecordError(
                    f"'{key}' must be an integer >= 0 or null, got {value!r}")
        for key in ("ttft", "latency"):
            value = data.get(key)
            if value is not None and (not _is_number(value) or value < 0):
                raise TrafficRecordError(f"'{key}' must be a number of seconds >= 0 or null, "
                                         f"got {value!r}")
        source = data.get("source")
        if source is not None and not isinstance(source, str):
            raise TrafficRecordError(f"'source' must be a string or null, got {source!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_json_lines(path: str) -> Iterator[tuple[int, Any]]:
    """(line number from 1, decoded value) of every non-blank line of a JSONL file;
    TrafficRecordError naming the file (and the line) if it cannot be read or a line is not JSON."""
    if not os.path.isfile(path):
        raise TrafficRecordError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise TrafficRecordError(f"{path}: line {number}: not JSON ({e.msg} at "
                                             f"column {e.colno})") from None
    except OSError as e:
        raise TrafficRecordError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise TrafficRecordError(f"{path}: not UTF-8 text") from None


def read_traffic(path: str) -> list[TrafficEntry]:
    """The entries of a traffic record, in arrival order (ties: file order); TrafficRecordError
    naming the file and line of the first bad line, or saying the file has none."""
    entries = []
    for number, data in read_json_lines(path):
        try:
            entries.append(TrafficEntry.from_json(data))
        except ValueError as e:
            raise TrafficRecordError(f"{path}: line {number}: {e}") from None
    if not entries:
        raise TrafficRecordError(f"{path}: no traffic entries (one JSON object per line)")
    return sorted(entries, key=lambda entry: entry.arrival)


class TrafficWriter:
    """Writes entries to a traffic record, one line each, flushed at once (a crash loses no
    finished line). Safe to call from several threads; the file is created (or emptied) when
    the writer is made, so a path that cannot be written fails early (OSError)."""

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = path
        self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, entry: TrafficEntry) -> None:
        line = json.dumps(entry.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- redaction -----------------------------------------------------------------------------


def placeholder_text(num_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """PLACEHOLDER_WORD repeated so that the text counts `num_tokens` tokens (or as close as a
    few corrections get, for a tokenizer that merges the repetitions)."""
    if num_tokens <= 0:
        return ""
    words = num_tokens
    best, best_error = "", num_tokens
    for _ in range(6):
        text = " ".join([PLACEHOLDER_WORD] * words)
        error = count_tokens(text) - num_tokens
        if abs(error) < abs(best_error):
            best, best_error = text, error
        if error == 0:
            break
        words = max(1, words - error)
    return best


def redact_body(body: dict, count_tokens: Callable[[str], int]) -> dict:
    """A copy of a completions or chat request body whose user text is replaced by
    placeholders of the same token count (`count_tokens`: the model's tokenizer, no special
    tokens): the prompt (a string, strings, or token ids, which become a placeholder string of
    as many tokens), each message's `content` (a string, or the `text` of its parts).
    Roles, structure, max_tokens and every other field are kept."""

    def redact(text: str) -> str:
        return placeholder_text(count_tokens(text), count_tokens)

    def redact_prompt(prompt: Any) -> Any:
        if isinstance(prompt, str):
            return redact(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return placeholder_text(len(prompt), count_tokens)  # token ids are text too
        if isinstance(prompt, list):
            return [redact_prompt(p) for p in prompt]
        return prompt

    redacted = copy.deepcopy(body)
    if "prompt" in redacted:
        redacted["prompt"] = redact_prompt(redacted["prompt"])
    messages = redacted.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                message["content"] = redact(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = redact(part["text"])
    return redacted
