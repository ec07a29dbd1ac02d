"""Public traces as traffic (pagoda/ab/trace_import.py): each importer on a small file of its
format, with its arrivals, token counts within 2% under the bundled tokenizer, Mooncake's shared
prefixes, and bad rows named by file and line."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pagoda.ab.trace_import import MOONCAKE_BLOCK_TOKENS, TextSynthesizer, load_trace
from pagoda.bench import BenchError
from pagoda.traffic_record import TrafficEntry, TrafficRecordError, TrafficWriter


@pytest.fixture(scope="module")
def count_tokens(bundled_tokenizer):
    return lambda text: len(bundled_tokenizer.encode(text))


def within_2_percent(got: int, asked: int) -> bool:
    return abs(got - asked) <= 0.02 * asked


SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "You are helpful."},
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "The capital of France is Paris, a city on the Seine."},
        {"from": "human", "value": "And of Italy?"},
        {"from": "gpt", "value": "Rome."},
    ]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "nobody asked"}]},  # skipped
    {"id": "c", "conversations": [
        {"from": "human", "value": "Write a haiku about rain."},
        {"from": "gpt", "value": "Soft rain on the roof\nthe garden drinks in silence\n"
                                 "puddles hold the sky"},
    ]},
]


@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_sharegpt_turns_carry_their_history_and_arrive_by_poisson(
        tmp_path, bundled_tokenizer, count_tokens, layout) -> None:
    path = tmp_path / f"sharegpt.{layout}"
    path.write_text(json.dumps(SHAREGPT) if layout == "json"
                    else "\n".join(json.dumps(c) for c in SHAREGPT))
    entries = load_trace(str(path), "sharegpt", bundled_tokenizer, rate=2.0, seed=3)
    assert len(entries) == 3 and all(e.endpoint == "chat" for e in entries)
    assert entries[0].arrival == 0.0
    arrivals = [e.arrival for e in entries]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    by_question = {e.body["messages"][-1]["content"]: e for e in entries}
    second = by_question["And of Italy?"]
    assert [m["role"] for m in second.body["messages"]] == [
        "system", "user", "assistant", "user"]
    assert second.body["messages"][2]["content"].startswith("The capital of France is Paris")
    first = by_question["What is the capital of France?"]
    assert first.arrival < second.arrival  # a conversation's turns stay in order
    haiku = by_question["Write a haiku about rain."]
    reply = SHAREGPT[2]["conversations"][1]["value"]
    assert haiku.body["max_tokens"] == haiku.output_tokens == count_tokens(reply)
    assert second.body["max_tokens"] == count_tokens("Rome.")
    assert all(e.source == "sharegpt" for e in entries)
    again = load_trace(str(path), "sharegpt", bundled_tokenizer, rate=2.0, seed=3)
    assert again == entries  # the seed fixes everything
    assert len(load_trace(str(path), "sharegpt", bundled_tokenizer, max_requests=2)) == 2
    at_once = load_trace(str(path), "sharegpt", bundled_tokenizer, rate=math.inf)
    assert [e.arrival for e in at_once] == [0.0] * 3


def test_sharegpt_bad_entries_are_named(tmp_path, bundled_tokenizer) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SHAREGPT[0]) + "\n"
                    + json.dumps({"conversations": [{"from": "alien", "value": "hi"}]}) + "\n")
    with pytest.raises(BenchError, match=f"{path}: line 2: .*unknown turn"):
        load_trace(str(path), "sharegpt", bundled_tokenizer)
    path.write_text('{"conversations": []}\n{"conversations": [\n')
    with pytest.raises(TrafficRecordError, match=f"{path}: line 2: not JSON"):
        load_trace(str(path), "sharegpt", bundled_tokenizer)
    path.write_text(json.dumps([SHAREGPT[0], 7]))
    with pytest.raises(BenchError, match=f"{path}: entry 1: "):
        load_trace(str(path), "sharegpt", bundled_tokenizer)


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.1200000,879,0
2023-11-16 18:16:00.0000001,1,7
"""


def test_azure_rows_become_completions_at_their_times(tmp_path, bundled_tokenizer,
                                                      count_tokens) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    entries = load_trace(str(path), "azure", bundled_tokenizer, seed=1)
    assert [e.arrival for e in entries] == pytest.approx([0.0, 4.314579, 4.43941, 13.31941])
    assert [e.prompt_tokens for e in entries] == [374, 396, 879, 1]
    for entry in entries:
        assert entry.endpoint == "completions" and entry.source == "azure-trace"
        assert within_2_percent(count_tokens(entry.body["prompt"]), entry.prompt_tokens)
    assert [e.body["max_tokens"] for e in entries] == [44, 109, 1, 7]  # 0 asks for 1
    assert entries[1].body["ignore_eos"] is True
    assert entries[0].body["prompt"] != entries[1].body["prompt"]
    assert load_trace(str(path), "azure", bundled_tokenizer, seed=1) == entries
    iso = tmp_path / "iso.csv"
    iso.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2024-05-10T00:00:01+00:00,10,2\n2024-05-10T00:00:00.5Z,10,2\n")
    assert [e.arrival for e in load_trace(str(iso), "azure", bundled_tokenizer)] == [0.0, 0.5]


def test_a_thousand_azure_rows_import_in_seconds(tmp_path, bundled_tokenizer,
                                                 count_tokens) -> None:
    path = tmp_path / "azure.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}.1234567,{50 + i * 7 % 3000},"
              f"{1 + i % 300}" for i in range(1000)]
    path.write_text("\n".join(lines) + "\n")
    load_trace(str(path), "azure", bundled_tokenizer, max_requests=1)  # the word pool, once
    start = time.perf_counter()
    entries = load_trace(str(path), "azure", bundled_tokenizer)
    assert time.perf_counter() - start < 20  # ~0.2 s when the machine is not busy
    assert len(entries) == 1000
    for entry in entries[::97]:
        assert within_2_percent(count_tokens(entry.body["prompt"]), entry.prompt_tokens)


@pytest.mark.parametrize(("row", "fragment"), [
    ("2023-11-16 18:15:47.1,12,abc", "GeneratedTokens must be a whole number"),
    ("2023-11-16 18:15:47.1,-3,5", "ContextTokens must be >= 0"),
    ("yesterday,12,5", "TIMESTAMP 'yesterday' is not a date"),
])
def test_azure_bad_rows_are_named(tmp_path, bundled_tokenizer, row, fragment) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE.splitlines()[0] + "\n" + AZURE.splitlines()[1] + "\n" + row + "\n")
    with pytest.raises(BenchError, match=f"{path}: line 3: {fragment}"):
        load_trace(str(path), "azure", bundled_tokenizer)
    path.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(BenchError, match=f"{path}: line 1: not an Azure trace header"):
        load_trace(str(path), "azure", bundled_tokenizer)


MOONCAKE = [
    {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 7]},
    {"timestamp": 0, "input_length": 600, "output_length": 30, "hash_ids": [9, 10]},
    {"timestamp": 2250, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1]},
]


def test_mooncake_requests_share_text_where_hash_ids_match(tmp_path, bundled_tokenizer,
                                                          count_tokens) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MOONCAKE))
    entries = load_trace(str(path), "mooncake", bundled_tokenizer, seed=5)
    assert [e.arrival for e in entries] == [0.0, 1.0, 1.5, 2.25]
    assert [e.prompt_tokens for e in entries] == [600, 1200, 1100, 1500]
    assert [e.body["max_tokens"] for e in entries] == [30, 10, 20, 5]
    for entry in entries:
        assert within_2_percent(count_tokens(entry.body["prompt"]), entry.prompt_tokens)
        assert entry.source == "mooncake"
    a, b, c = (bundled_tokenizer.encode(e.body["prompt"]) for e in entries[1:])
    shared = 2 * MOONCAKE_BLOCK_TOKENS
    assert a[:shared] == b[:shared] == c[:shared]  # blocks 0 and 1
    assert a[shared:shared + 50] != b[shared:shared + 50]  # block 2 against block 7
    assert c[shared:shared + 50] != a[shared:shared + 50]  # past its blocks: its own text
    other = bundled_tokenizer.encode(entries[0].body["prompt"])
    assert other[:50] != a[:50]
    reseeded = load_trace(str(path), "mooncake", bundled_tokenizer, seed=6)
    assert reseeded[1].body["prompt"] != entries[1].body["prompt"]
    first_two = load_trace(str(path), "mooncake", bundled_tokenizer, seed=5, max_requests=2)
    assert [e.arrival for e in first_two] == [0.0, 0.5]  # the file's first rows


@pytest.mark.parametrize(("line", "fragment"), [
    ('{"timestamp": 5, "output_length": 3}', "missing 'input_length'"),
    ('{"timestamp": "noon", "input_length": 3, "output_length": 3}', "'timestamp' must be"),
    ('{"timestamp": 5, "input_length": 3.5, "output_length": 3}', "'input_length' must be"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 3, "hash_ids": [-1]}', "'hash_ids'"),
    ('{"timestamp": 5,', "not JSON"),
])
def test_mooncake_bad_lines_are_named(tmp_path, bundled_tokenizer, line, fragment) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + "\n" + line + "\n")
    # (a line that is not JSON is the JSONL reader's TrafficRecordError)
    with pytest.raises((BenchError, TrafficRecordError), match=f"{path}: line 2: .*{fragment}"):
        load_trace(str(path), "mooncake", bundled_tokenizer)


def test_pagoda_records_and_bad_arguments(tmp_path, bundled_tokenizer) -> None:
    path = str(tmp_path / "traffic.jsonl")
    with TrafficWriter(path) as writer:
        for i in range(3):
            writer.write(TrafficEntry(float(i), "completions", {"prompt": str(i)}))
    assert [e.body["prompt"] for e in load_trace(path, "pagoda", None, max_requests=2)] == [
        "0", "1"]
    with pytest.raises(BenchError, match="must be one of pagoda, sharegpt, azure, mooncake"):
        load_trace(path, "csv", bundled_tokenizer)
    with pytest.raises(BenchError, match="no such file"):
        load_trace(str(tmp_path / "nope.csv"), "azure", bundled_tokenizer)
    with pytest.raises(BenchError, match="needs the model's tokenizer"):
        load_trace(path, "azure", None)
    with pytest.raises(BenchError, match="rate must be"):
        load_trace(path, "sharegpt", bundled_tokenizer, rate=0)


def test_text_is_recounted_and_corrected_where_the_pool_is_not_known_exact(
        bundled_tokenizer) -> None:
    synth = TextSynthesizer(bundled_tokenizer)
    assert synth.exact  # SmolLM2's BPE splits at spaces
    synth.exact = False  # the path of tokenizers that may merge words
    rng = np.random.default_rng(0)
    for num_tokens in (1, 37, 700):
        text = synth.text(synth.random_words(rng, num_tokens + 3), num_tokens, rng)
        assert len(bundled_tokenizer.encode(text, add_special_tokens=False)) == num_tokens
        text = synth.text(synth.random_words(rng, max(1, num_tokens - 3)), num_tokens, rng)
        assert len(bundled_tokenizer.encode(text, add_special_tokens=False)) == num_tokens
