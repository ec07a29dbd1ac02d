"""Workloads: exact random prompt lengths, shared prefixes, growing conversations, files."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import datasets
from pagoda.bench.client import RequestOptions, build_payload, conversation_messages


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf):
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_files(bundled_gguf))


def test_random_prompts_have_the_asked_token_count(tokenizer):
    conversations = datasets.random_dataset(tokenizer, 16, input_len=64, output_len=8,
                                            range_ratio=0.0, seed=0)
    assert len(conversations) == 16
    lengths = [len(tokenizer.encode(c.turns[0])) for c in conversations]
    assert lengths == [64] * 16
    assert all(c.output_lens == [8] for c in conversations)
    assert len({c.turns[0] for c in conversations}) == 16
    again = datasets.random_dataset(tokenizer, 16, 64, 8, 0.0, seed=0)
    assert [c.turns for c in again] == [c.turns for c in conversations]  # seeded


def test_random_range_ratio(tokenizer):
    conversations = datasets.random_dataset(tokenizer, 32, input_len=40, output_len=20,
                                            range_ratio=0.5, seed=1)
    inputs = [len(tokenizer.encode(c.turns[0])) for c in conversations]
    outputs = [c.output_lens[0] for c in conversations]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 3
    assert min(outputs) >= 10 and max(outputs) <= 30 and len(set(outputs)) > 3


def test_shared_prefix_groups_users_behind_few_system_prompts(tokenizer):
    conversations = datasets.shared_prefix_dataset(tokenizer, 8, num_prefixes=2, prefix_len=100,
                                                   input_len=10, output_len=4, seed=0)
    systems = [c.history[0]["content"] for c in conversations]
    assert len(set(systems)) == 2 and systems[0] == systems[2] != systems[1]
    assert all(len(tokenizer.encode(s)) == 100 for s in systems)
    assert len({c.turns[0] for c in conversations}) == 8
    payload = build_payload(RequestOptions(endpoint="completions"), conversations[0], 0, [])
    assert payload["prompt"].startswith(systems[0])


def test_multi_turn_requests_carry_the_real_replies(tokenizer):
    conversations = datasets.multi_turn_dataset(tokenizer, 10, num_turns=4, input_len=8,
                                                output_len=5, seed=0)
    assert [len(c.turns) for c in conversations] == [4, 4, 2]
    assert datasets.num_requests(conversations) == 10
    c = conversations[0]
    messages = conversation_messages(c, 2, ["reply one", "reply two"])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[1::2]] == ["reply one", "reply two"]
    assert messages[-1]["content"] == c.turns[2]
    chat = build_payload(RequestOptions(endpoint="chat", model="m"), c, 1, ["reply one"])
    assert chat["messages"][1] == {"role": "assistant", "content": "reply one"}
    assert chat["model"] == "m" and chat["max_tokens"] == 5
    assert chat["ignore_eos"] is True and chat["min_tokens"] == 5
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    completion = build_payload(RequestOptions(ignore_eos=False), c, 1, ["reply one"])
    assert completion["prompt"] == c.turns[0] + "reply one" + c.turns[1]
    assert "ignore_eos" not in completion and "min_tokens" not in completion


def test_file_dataset_formats(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    entries = [
        {"prompt": "Tell me a joke", "output_len": 5},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "2+2?"}]},
        {"conversations": [{"from": "system", "value": "You help."},
                           {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello! How can I help you today?"},
                           {"from": "human", "value": "More"}]},
    ]
    path.write_text("\n".join(json.dumps(e) for e in entries))
    conversations = datasets.load_file_dataset(str(path), 7, None, max_turns=2, seed=0,
                                               tokenizer=tokenizer)
    assert datasets.num_requests(conversations) == 7  # cycles through the file
    by_first_turn = {c.turns[0]: c for c in conversations}
    assert by_first_turn["Tell me a joke"].output_lens == [5]
    assert by_first_turn["2+2?"].history == [{"role": "system", "content": "Be brief."}]
    sharegpt = by_first_turn["Hi"]
    reply_len = len(tokenizer.encode("Hello! How can I help you today?", add_special_tokens=False))
    assert sharegpt.history == [{"role": "system", "content": "You help."}]
    assert sharegpt.output_lens[0] == reply_len
    # --output-len overrides the file; max_turns=1 keeps the first user turn only
    fixed = datasets.load_file_dataset(str(path), 3, 9, max_turns=1, seed=0, tokenizer=None)
    assert all(c.output_lens == [9] for c in fixed)
    # a JSON list works too
    path2 = tmp_path / "prompts.json"
    path2.write_text(json.dumps(["just a string", {"prompt": "x"}]))
    assert datasets.num_requests(
        datasets.load_file_dataset(str(path2), 2, None, 1, 0, None)) == 2


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ('{"foo": 1}', "needs 'prompt'"),
    ('{"prompt": "x", "output_len": 0}', "positive integer"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "user message"),
])
def test_bad_file_entries_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        datasets.load_file_dataset(str(path), 1, None, 1, 0, None)
