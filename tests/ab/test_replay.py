"""`pagoda bench ab`'s traffic (pagoda/ab/replay.py): blocks alternate between endpoints in
a balanced order, every request runs on every endpoint with the same start times, bodies
are replayed as recorded (streamed, the endpoint's model, the recorded output length)."""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

from pagoda.ab.replay import (
    Endpoint,
    ReplayConfig,
    block_order,
    block_start_times,
    blocks_of,
    conversations_of,
    pause_before,
    replay_body,
    run_ab,
)
from pagoda.bench import BenchError
from pagoda.traffic_record import TrafficEntry
from tests.helpers.fake_server import MODEL, FakeServer


def entry(i: int, arrival: float, output_tokens: int = 3, chat: bool = False) -> TrafficEntry:
    if chat:
        body = {"model": "recorded-name", "messages": [{"role": "user", "content": f"q{i}"}],
                "max_tokens": 50, "temperature": 0}
    else:
        body = {"model": "recorded-name", "prompt": f"prompt {i}", "max_tokens": 50,
                "temperature": 0.7, "stream": False}
    return TrafficEntry(arrival=arrival, endpoint="chat" if chat else "completions", body=body,
                        prompt_tokens=2, output_tokens=output_tokens)


def test_two_endpoints_alternate_ab_ba_and_more_rotate_evenly() -> None:
    assert [block_order(["A", "B"], b) for b in range(4)] == [
        ["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    names = ["A", "B", "C"]
    orders = [block_order(names, b) for b in range(6)]
    assert all(sorted(o) == names for o in orders)
    # over a whole cycle each endpoint is first, and last, equally often
    assert Counter(o[0] for o in orders) == Counter({"A": 2, "B": 2, "C": 2})
    assert Counter(o[-1] for o in orders) == Counter({"A": 2, "B": 2, "C": 2})


def test_blocks_follow_arrival_order_and_keep_recorded_gaps() -> None:
    entries = [entry(0, 0.0), entry(1, 5.0), entry(2, 1.0), entry(3, 2.5), entry(4, 9.0)]
    conversations = conversations_of(entries)
    assert conversations == [[0], [2], [3], [1], [4]]  # completions: one request each
    assert blocks_of(conversations, 2) == [[[0], [2]], [[3], [1]], [[4]]]
    rng = np.random.default_rng(0)
    assert block_start_times(entries, [[3], [1]], ReplayConfig(time_scale=0.5),
                             rng) == [0.0, 1.25]
    assert block_start_times(entries, [[3], [1]], ReplayConfig(request_rate=float("inf")),
                             rng) == [0.0, 0.0]
    poisson = block_start_times(entries, [[0], [2], [3], [1]], ReplayConfig(request_rate=4.0),
                                rng)
    assert poisson[0] == 0.0 and all(b >= a for a, b in pairwise(poisson))


def chat_turn(arrival: float, history: list[dict], user: str, latency: float = 0.5):
    messages = [*history, {"role": "user", "content": user}]
    return TrafficEntry(arrival=arrival, endpoint="chat", latency=latency, output_tokens=3,
                        body={"messages": messages, "max_tokens": 3, "temperature": 0})


def test_a_turn_that_continues_a_conversation_is_found_by_its_history() -> None:
    system = [{"role": "system", "content": "be brief"}]
    a1 = chat_turn(0.0, system, "hi")
    b1 = chat_turn(0.2, system, "hi")  # the same first turn, another user
    a2 = chat_turn(1.0, [*a1.body["messages"], {"role": "assistant", "content": "hello"}], "and?")
    b2 = chat_turn(1.5, [*b1.body["messages"], {"role": "assistant", "content": "hey"}], "so?")
    a3 = chat_turn(2.0, [*a2.body["messages"], {"role": "assistant", "content": "x"}], "ok")
    other = entry(0, 0.1)
    entries = [a3, b2, other, a2, b1, a1]
    # in arrival order: a1, other, b1, a2 (after a1's reply), b2 (after b1's), a3 (after a2's)
    assert conversations_of(entries) == [[5, 3, 0], [2], [4, 1]]
    # blocks hold whole conversations
    assert blocks_of(conversations_of(entries), 2) == [[[5, 3, 0]], [[2], [4, 1]]]
    # the user's pause: a2 came 1.0 s after a1, whose reply took 0.5 s
    assert pause_before(entries, 5, 3, ReplayConfig()) == pytest.approx(0.5)
    assert pause_before(entries, 5, 3, ReplayConfig(time_scale=2.0)) == pytest.approx(1.0)


def test_replayed_body_streams_with_usage_and_the_recorded_output_length() -> None:
    original = entry(0, 0.0, output_tokens=7)
    body = replay_body(original, Endpoint("A", "http://x", model="served"), ReplayConfig())
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "served" and body["prompt"] == "prompt 0"
    assert body["max_tokens"] == body["min_tokens"] == 7 and body["ignore_eos"] is True
    assert original.body["max_tokens"] == 50 and original.body["stream"] is False  # not mutated
    unmatched = replay_body(original, Endpoint("A", "http://x"),
                            ReplayConfig(match_output_lengths=False))
    assert unmatched["max_tokens"] == 50 and "ignore_eos" not in unmatched
    assert unmatched["model"] == "recorded-name"


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"repeats": 0}, {"time_scale": 0},
                                 {"request_rate": -1.0}, {"max_concurrency": 0},
                                 {"num_warmups": -1}, {"timeout": 0}])
def test_bad_replay_settings_name_the_flag(bad) -> None:
    with pytest.raises(ValueError, match="--"):
        ReplayConfig(**bad)


def test_every_request_runs_on_every_endpoint_block_by_block() -> None:
    entries = [entry(i, 0.01 * i, output_tokens=3, chat=i % 2 == 1) for i in range(6)]
    config = ReplayConfig(block_size=2, repeats=2, num_warmups=1)
    with FakeServer(delay=0.002) as a, FakeServer(delay=0.02) as b:
        endpoints = [Endpoint("A", a.url, model=MODEL), Endpoint("B", b.url, model=MODEL)]
        rows, duration = asyncio.run(run_ab(endpoints, entries, config))
        sent_a, sent_b = list(a.requests), list(b.requests)
    # 1 warm-up + 6 entries x 2 repeats each; warm-ups are not in the rows
    assert len(sent_a) == len(sent_b) == 13
    assert len(rows) == 2 * 6 * 2 and all(r["success"] for r in rows)
    pairs = Counter((r["key"], r["repeat"]) for r in rows)
    assert set(pairs.values()) == {2}  # each (request, repeat) once per endpoint
    # blocks alternate A B / B A: the row order shows which endpoint served each block first
    firsts = []
    for block in range(6):
        names = [r["endpoint"] for r in rows if r["block"] == block]
        firsts.append(names[0])
        assert names == [names[0]] * 2 + [names[-1]] * 2 and names[0] != names[-1]
    assert firsts == ["A", "B"] * 3
    for sent in (sent_a[1:], sent_b[1:]):
        assert all(s["stream"] and s["model"] == MODEL and s["max_tokens"] == 3 for s in sent)
        # the second pass is tagged, so that no prompt cache serves it from the first
        texts = [s["prompt"] if "prompt" in s else s["messages"][0]["content"] for s in sent]
        assert sorted(texts[:6]) == sorted(["prompt 0", "q1", "prompt 2", "q3", "prompt 4", "q5"])
        assert all(t.startswith("[pass 2] ") for t in texts[6:])
    for r in rows:
        assert r["output_tokens"] == 3 and r["ttft"] is not None
        # greedy requests (temperature 0: the chat ones) keep their text for agreement
        assert r["greedy"] == (entries[r["key"]].endpoint == "chat")
        assert (r["output_text"] == " w0 w1 w2") if r["greedy"] else r["output_text"] is None
    # B streams 10x slower per token: its serving time is longer, measured apart from A's
    assert duration["B"] > duration["A"] > 0


def test_a_trace_that_cannot_be_replayed_is_refused() -> None:
    with pytest.raises(BenchError, match="no requests"):
        asyncio.run(run_ab([Endpoint("A", "http://x"), Endpoint("B", "http://y")], [],
                           ReplayConfig()))
    odd = TrafficEntry(arrival=0.0, endpoint="embeddings", body={"input": "x"})
    with pytest.raises(BenchError, match="embeddings"):
        asyncio.run(run_ab([Endpoint("A", "http://x"), Endpoint("B", "http://y")], [odd],
                           ReplayConfig()))


def test_each_endpoint_gets_the_next_turn_only_after_its_own_reply() -> None:
    """A slow server is not sent turn 2 at the time the fast one was: it waits for the reply."""
    first = chat_turn(0.0, [], "hi", latency=0.05)
    second = chat_turn(0.06, [*first.body["messages"], {"role": "assistant", "content": "w"}],
                       "more", latency=0.05)
    config = ReplayConfig(num_warmups=0)
    with FakeServer(delay=0.001) as fast, FakeServer(delay=0.15) as slow:
        endpoints = [Endpoint("fast", fast.url, model=MODEL), Endpoint("slow", slow.url,
                                                                        model=MODEL)]
        rows, _ = asyncio.run(run_ab(endpoints, [first, second], config))
        sent = {"fast": list(fast.requests), "slow": list(slow.requests)}
        rows_recorded, _ = asyncio.run(run_ab(endpoints, [first, second],
                                              ReplayConfig(num_warmups=0, recorded_replies=True)))
        resent = slow.requests[2:]
    # turn 2 carries the endpoint's own reply to turn 1, not the recorded "w" ...
    for name in ("fast", "slow"):
        assert [m["content"] for m in sent[name][1]["messages"]] == ["hi", " w0 w1 w2", "more"]
    # ... unless the recorded replies are asked for
    assert [m["content"] for m in resent[1]["messages"]] == ["hi", "w", "more"]
    assert len(rows_recorded) == 4
    by = {(r["endpoint"], r["key"]): r for r in rows}
    # the report compares outputs only where histories match: turn 2 carried its own reply
    assert [by[("slow", k)]["live_history"] for k in (0, 1)] == [False, True]
    assert not any(r["live_history"] for r in rows_recorded)
    for name in ("fast", "slow"):
        reply_end = by[(name, 0)]["start"] + by[(name, 0)]["latency"]
        # sent after its own reply ended plus the recorded 10 ms pause
        assert by[(name, 1)]["start"] >= reply_end + 0.009
    assert by[("slow", 0)]["latency"] > 0.25  # 3 chunks 150 ms apart
