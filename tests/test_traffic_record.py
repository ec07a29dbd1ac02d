"""The traffic record (pagoda/traffic_record.py): entries survive a write and a read, bad lines
are named, and redaction keeps every request's token counts (within 2%) and none of its words."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pagoda.bench.prose import passage
from pagoda.traffic_record import (
    TrafficEntry,
    TrafficRecordError,
    TrafficWriter,
    read_traffic,
    redact_body,
)


def test_entries_round_trip_in_arrival_order(tmp_path) -> None:
    path = str(tmp_path / "traffic.jsonl")
    entries = [
        TrafficEntry(0.0, "chat", {"messages": [{"role": "user", "content": "héllo"}],
                                   "max_tokens": 8, "stream": True},
                     prompt_tokens=12, output_tokens=8, ttft=0.01, latency=0.2, status=200,
                     source="pagoda serve"),
        TrafficEntry(0.5, "completions", {"prompt": "a", "max_tokens": 3}),
        TrafficEntry(0.25, "completions", {"prompt": ["b", "c"]}, status=400),
    ]
    with TrafficWriter(path) as writer:
        threads = [threading.Thread(target=writer.write, args=(e,)) for e in entries]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    with open(path, encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 3  # one line each
    assert read_traffic(path) == sorted(entries, key=lambda e: e.arrival)
    assert TrafficEntry.from_json(entries[0].to_json()) == entries[0]


@pytest.mark.parametrize(("line", "fragment"), [
    ("{not json", "not JSON"),
    ('{"arrival": 0, "body": {}}', "missing 'endpoint'"),
    ('{"arrival": -1, "endpoint": "chat", "body": {}}', "'arrival'"),
    ('{"arrival": 0, "endpoint": "embeddings", "body": {}}', "'endpoint'"),
    ('{"arrival": 0, "endpoint": "chat", "body": "hi"}', "'body'"),
    ('{"arrival": 0, "endpoint": "chat", "body": {}, "prompt_tokens": 1.5}', "'prompt_tokens'"),
    ("[1, 2]", "JSON object"),
])
def test_a_bad_line_is_named_with_its_file_and_number(tmp_path, line, fragment) -> None:
    path = tmp_path / "traffic.jsonl"
    good = json.dumps(TrafficEntry(0.0, "chat", {"messages": []}).to_json())
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TrafficRecordError, match=f"{path}: line 3: .*{fragment}"):
        read_traffic(str(path))


def test_missing_and_empty_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(TrafficRecordError, match="no such file"):
        read_traffic(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TrafficRecordError, match="no traffic entries"):
        read_traffic(str(tmp_path / "empty.jsonl"))


@pytest.fixture(scope="module")
def count_tokens(bundled_tokenizer):
    return lambda text: len(bundled_tokenizer.encode(text, add_special_tokens=False))


def prose(tokenizer, seed: int, num_tokens: int) -> str:
    return passage(tokenizer, np.random.default_rng(seed), num_tokens)


def within_2_percent(redacted: int, original: int) -> bool:
    return abs(redacted - original) <= 0.02 * original


def test_redacted_completions_keep_token_counts_and_no_words(bundled_tokenizer,
                                                             count_tokens) -> None:
    texts = [prose(bundled_tokenizer, seed, n) for seed, n in ((0, 40), (1, 300))]
    texts.append("Line one,\n\tline two: 3.14159 — naïve café «quoted» 🚀 end.")
    body = {"model": "m", "prompt": texts[0], "max_tokens": 17, "temperature": 0.7,
            "stream": True, "stop": ["\n\n"]}
    redacted = redact_body(body, count_tokens)
    assert within_2_percent(count_tokens(redacted["prompt"]), count_tokens(texts[0]))
    assert {k: v for k, v in redacted.items() if k != "prompt"} == {
        k: v for k, v in body.items() if k != "prompt"}
    assert body["prompt"] == texts[0]  # the caller's body is left alone

    many = redact_body({"prompt": texts}, count_tokens)["prompt"]
    assert len(many) == len(texts)
    for original, placeholder in zip(texts, many):
        assert within_2_percent(count_tokens(placeholder), count_tokens(original))
    words = {w for t in texts for w in t.split() if len(w) > 3}
    assert not words & set(" ".join(many).split())

    ids = bundled_tokenizer.encode(texts[1], add_special_tokens=False)
    as_ids = redact_body({"prompt": [ids, ids[:5]]}, count_tokens)["prompt"]
    assert [count_tokens(p) for p in as_ids] == [len(ids), 5]


def test_redacted_chat_keeps_roles_structure_and_counts(bundled_tokenizer, count_tokens) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant for the Acme Corporation."},
        {"role": "user", "content": prose(bundled_tokenizer, 2, 120)},
        {"role": "assistant", "content": prose(bundled_tokenizer, 3, 80), "name": "bot"},
        {"role": "user", "content": [
            {"type": "text", "text": prose(bundled_tokenizer, 4, 60)},
            {"type": "text", "text": "Summarize the passage about the miller, please."}]},
    ]
    body = {"messages": messages, "max_tokens": 64, "tools": [], "temperature": 0}
    redacted = redact_body(body, count_tokens)
    assert redacted["max_tokens"] == 64 and redacted["tools"] == [] and redacted["temperature"] == 0
    assert [m["role"] for m in redacted["messages"]] == [m["role"] for m in messages]
    assert redacted["messages"][2]["name"] == "bot"
    parts = redacted["messages"][3]["content"]
    assert [p["type"] for p in parts] == ["text", "text"]

    def texts(ms):
        return [m["content"] if isinstance(m["content"], str) else p["text"]
                for m in ms for p in (m["content"] if isinstance(m["content"], list) else [m])]

    for original, placeholder in zip(texts(messages), texts(redacted["messages"])):
        assert within_2_percent(count_tokens(placeholder), count_tokens(original))
        assert not {w for w in original.split() if len(w) > 3} & set(placeholder.split())
    # The whole prompt, as the chat template renders it, keeps its length too.
    rendered = [count_tokens(bundled_tokenizer.apply_chat_template(
        [{"role": m["role"], "content": "\n".join(texts([m]))} for m in ms], tokenize=False))
        for ms in (messages, redacted["messages"])]
    assert rendered[0] > 300 and within_2_percent(rendered[1], rendered[0])
