"""The grounded workload: seeded English passages of the asked length, each followed by a copy
instruction, sent through both endpoints by `pagoda bench serve`."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pagoda.bench import datasets, prose
from tests.bench.test_serve_fake import run_bench
from tests.helpers.fake_server import FakeServer

LONGEST_SENTENCE = 30
"""More tokens than any sentence of pagoda/bench/prose.py takes (with the bundled tokenizer)."""


def split_prompt(prompt: str) -> tuple[str, str]:
    passage, _, instruction = prompt.rpartition("\n\n")
    return passage, instruction


def test_prompts_are_seeded_distinct_passages_with_an_instruction(bundled_tokenizer):
    conversations = datasets.grounded_dataset(bundled_tokenizer, 12, passage_len=400,
                                              output_len=16, range_ratio=0.0, seed=0)
    prompts = [c.turns[0] for c in conversations]
    assert len(set(prompts)) == 12
    assert [c.turns for c in datasets.grounded_dataset(bundled_tokenizer, 12, 400, 16, 0.0,
                                                       seed=0)] == [[p] for p in prompts]
    others = datasets.grounded_dataset(bundled_tokenizer, 12, 400, 16, 0.0, seed=1)
    assert not set(prompts) & {c.turns[0] for c in others}
    for i, (c, prompt) in enumerate(zip(conversations, prompts)):
        passage, instruction = split_prompt(prompt)
        n = datasets.COPY_INSTRUCTIONS
        assert instruction == n[i % len(n)]
        assert 400 <= len(bundled_tokenizer.encode(passage, add_special_tokens=False)) \
            < 400 + LONGEST_SENTENCE
        assert re.fullmatch(r"[A-Za-z ,.\n]+", passage)  # words, not random tokens
        assert passage.count("\n\n") >= 2  # paragraphs (the last instruction quotes one)
        assert c.output_lens == [16] and c.prompt_lens == [len(bundled_tokenizer.encode(prompt))]


def test_short_passages_and_spread_lengths(bundled_tokenizer):
    conversations = datasets.grounded_dataset(bundled_tokenizer, 16, passage_len=60,
                                              output_len=20, range_ratio=0.5, seed=3)
    passage_lens = [len(bundled_tokenizer.encode(split_prompt(c.turns[0])[0],
                                                 add_special_tokens=False))
                    for c in conversations]
    assert min(passage_lens) >= 30 and max(passage_lens) < 90 + LONGEST_SENTENCE
    assert len(set(passage_lens)) > 3
    outputs = [c.output_lens[0] for c in conversations]
    assert min(outputs) >= 10 and max(outputs) <= 30 and len(set(outputs)) > 3


def test_sentences_read_as_english():
    rng = np.random.default_rng(0)
    for _ in range(50):
        text = prose.sentence(rng)
        assert text[0].isupper() and text.endswith(".") and "{" not in text
        assert " a old" not in text and " a honest" not in text.lower()
    assert prose.with_article("honest") == "an honest"
    assert prose.with_article("heavy") == "a heavy"


@pytest.mark.parametrize("endpoint, extra, passage_len", [
    ("chat", [], 400),
    ("completions", ["--input-len", "64"], 64),
])
def test_bench_serve_sends_grounded_prompts(tmp_path, endpoint, extra, passage_len):
    out = tmp_path / "r.json"
    with FakeServer() as server:
        assert run_bench("--base-url", server.url, "--endpoint", endpoint,
                         "--dataset", "grounded", "--num-requests", "3", "--output-len", "4",
                         "--output", str(out), *extra) == 0
        bodies = list(server.requests)
    if endpoint == "chat":
        prompts = [b["messages"][-1]["content"] for b in bodies]
        assert all(len(b["messages"]) == 1 for b in bodies)
    else:
        prompts = [b["prompt"] for b in bodies]
    assert len(set(prompts)) == 3
    # rate=inf sends all three at once, so they may arrive in any order.
    assert sorted(split_prompt(p)[1] for p in prompts) == sorted(datasets.COPY_INSTRUCTIONS[:3])
    assert all(b["max_tokens"] == 4 for b in bodies)
    result = json.loads(out.read_text())
    assert result["config"]["dataset"] == "grounded"
    assert result["config"]["input_len"] == passage_len
    assert result["runs"][0]["summary"]["completed"] == 3
