"""The ingress's start of a response (pagoda/deploy/ingress.py `start_response`), without a
cluster: a replica that dies before its response started hands the request to the next
one; the request is lost only after START_ATTEMPTS dead replicas or no replica at all."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="make test installs Ray Serve (ray[serve])")

from pagoda.deploy.forwarding import ACCEPTED
from pagoda.deploy.ingress import START_ATTEMPTS, NoReplica, start_response


class ReplicaDied(Exception):
    pass


class FakeStream:
    """One replica's streaming response: `items` in order; an exception item is raised
    there (the replica died); "hang" never answers."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self):
        item = self.items.pop(0)
        if item == "hang":
            await asyncio.sleep(3600)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def opener(streams: list[FakeStream]):
    sent = []

    def open_stream() -> FakeStream:
        sent.append(streams[len(sent)])
        return sent[-1]

    return open_stream, sent


def test_a_request_whose_replicas_die_before_responding_runs_on_the_next() -> None:
    good = FakeStream([ACCEPTED, ("start", 200, [(b"content-type", b"text/event-stream")]),
                       b"data: hi\n\n"])
    open_stream, sent = opener([
        FakeStream([ReplicaDied("before accepting")]),
        FakeStream([ACCEPTED, ReplicaDied("before its response started")]),
        good,
    ])
    chunks, status, headers = asyncio.run(start_response(open_stream, 5.0))
    assert len(sent) == 3 and chunks is good and status == 200
    assert headers == [(b"content-type", b"text/event-stream")]
    assert good.items == [b"data: hi\n\n"]  # the body is left for the caller to relay


def test_the_request_is_lost_after_every_attempt_died() -> None:
    open_stream, sent = opener([FakeStream([ACCEPTED, ReplicaDied("x")])
                                for _ in range(START_ATTEMPTS + 1)])
    with pytest.raises(NoReplica, match="died"):
        asyncio.run(start_response(open_stream, 5.0))
    assert len(sent) == START_ATTEMPTS


def test_no_replica_accepting_in_time_is_not_retried() -> None:
    waiting = FakeStream(["hang"])
    open_stream, sent = opener([waiting, FakeStream([ACCEPTED])])
    with pytest.raises(NoReplica, match="waited 0.2 s"):
        asyncio.run(start_response(open_stream, 0.2))
    assert sent == [waiting] and waiting.cancelled
