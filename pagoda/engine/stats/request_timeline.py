"""A bounded record of recent requests' timelines, for the web view's per-request chart and
its TTFT/TPOT percentiles.

One record per sequence (a request with n > 1 has n, named by their sequence ids):

    arrival ── queued ── chunk ─ chunk ─ ... ── first token ── decode ... ── finish
                         (start, end, tokens) of each step that computed known tokens
                         (prompt, or prompt + output again after a preemption)

The engine thread is the only writer (`add`, `record_prefill`, `record_first_tokens`,
`preempted`, `finish`); every reader takes `published`, an immutable tuple of frozen
records. Cost: records change only on rare events (arrival, a prefill chunk, first token,
preemption, finish), each rebuilding the tuple once per step at most; a decode-only step
does nothing here and republishes the same tuple.

Bounds: the last `max_finished` finished records plus the in-flight ones, capped at
`max_in_flight` (the oldest dropped beyond it, so a finish path this module never hears of
cannot leak memory).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, replace

DEFAULT_MAX_FINISHED = 100
DEFAULT_MAX_IN_FLIGHT = 4096


@dataclass(frozen=True)
class RequestTimeline:
    request_id: str
    """The sequence id (the caller's request id when n == 1)."""
    arrival_time: float
    """time.time() when it was added."""
    num_prompt_tokens: int
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()
    """(step start, step end, tokens computed) of each prefill step, recomputes included."""
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    """stop, length or abort (None while in flight)."""
    num_output_tokens: int = 0
    """Known at finish only (0 while in flight: counting per step would cost every step)."""
    num_preemptions: int = 0

    @property
    def first_scheduled_time(self) -> float | None:
        return self.prefill_chunks[0][0] if self.prefill_chunks else None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (finished with 2+ tokens only)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


class RequestTimelines:
    """The engine's running record (it publishes `published` in each snapshot)."""

    def __init__(self, max_finished: int = DEFAULT_MAX_FINISHED,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self.max_in_flight = max_in_flight
        self._finished: deque[RequestTimeline] = deque(maxlen=max_finished)
        self._in_flight: OrderedDict[str, RequestTimeline] = OrderedDict()
        self._published: tuple[RequestTimeline, ...] = ()
        self._dirty = False

    @property
    def published(self) -> tuple[RequestTimeline, ...]:
        """Finished records (oldest first), then in-flight ones (by arrival)."""
        if self._dirty:
            self._published = (*self._finished, *self._in_flight.values())
            self._dirty = False
        return self._published

    def add(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._in_flight[request_id] = RequestTimeline(request_id, arrival_time, num_prompt_tokens)
        if len(self._in_flight) > self.max_in_flight:
            self._in_flight.popitem(last=False)
        self._dirty = True

    def record_prefill(self, chunks: list[tuple[str, int]], start: float, end: float) -> None:
        """The step [start, end] computed `chunks`: (request id, tokens) of prefill work."""
        for request_id, num_tokens in chunks:
            record = self._in_flight.get(request_id)
            if record is not None:
                self._in_flight[request_id] = replace(
                    record, prefill_chunks=(*record.prefill_chunks, (start, end, num_tokens)))
                self._dirty = True

    def record_first_tokens(self, request_ids: list[str], time: float) -> None:
        """These requests sampled a token in the step that ended at `time` (the first one
        counts; later calls for the same request are ignored)."""
        for request_id in request_ids:
            record = self._in_flight.get(request_id)
            if record is not None and record.first_token_time is None:
                self._in_flight[request_id] = replace(record, first_token_time=time)
                self._dirty = True

    def preempted(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            record = self._in_flight.get(request_id)
            if record is not None:
                self._in_flight[request_id] = replace(
                    record, num_preemptions=record.num_preemptions + 1)
                self._dirty = True

    def finish(self, request_id: str, time: float, reason: str | None,
               num_output_tokens: int) -> None:
        record = self._in_flight.pop(request_id, None)
        if record is not None:
            self._finished.append(replace(record, finish_time=time, finish_reason=reason,
                                          num_output_tokens=num_output_tokens))
            self._dirty = True
