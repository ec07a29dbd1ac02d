"""Workloads for the benchmarks: what each simulated user sends.

Every workload is a list of `Conversation`s. A conversation has a fixed preamble (`history`:
a system prompt, or turns recorded in a file) and one or more user turns sent live; each
turn's request carries the preamble, the earlier user turns and the replies the server
really gave to them. A single-turn workload is conversations of one turn.

- random:        user text of `input_len` real tokens (random ids of the model's vocabulary,
                 decoded, re-encoded until the length is right), `output_len` tokens out.
- shared-prefix: a few long system prompts, each shared by many users with short questions:
                 the server's prefix cache should make all but the first prefill of a prefix
                 cheap.
- multi-turn:    users (conversations) of `num_turns` turns that grow turn by turn, each
                 turn re-sending the whole history (a shared system prompt of
                 `system_prompt_len` tokens, earlier user turns, the server's own replies)
                 and a new user message of `input_len` tokens.
- grounded:      a passage of `input_len` tokens of English prose (pagoda/bench/prose.py),
                 different for every request, then an instruction to copy from it (repeat
                 it, quote its first sentences, copy it with a word replaced): the output
                 copies the input, the workload where prompt-lookup speculation shines.
- a file:        JSON (a list) or JSONL of {"prompt": str}, {"messages": [...]} or
                 ShareGPT {"conversations": [{"from": "human"|"gpt"|"system", "value": str}]};
                 an entry may set "output_len" (or "max_tokens").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagoda.bench import BenchError
from pagoda.bench.prose import passage

BUILTIN_DATASETS = ("random", "shared-prefix", "multi-turn", "grounded")
DEFAULT_INPUT_LEN = 128
DEFAULT_GROUNDED_PASSAGE_LEN = 400
DEFAULT_OUTPUT_LEN = 128

COPY_INSTRUCTIONS = (
    "Repeat the text above word for word.",
    "Quote the first three sentences of the text above exactly.",
    "Copy the text above, replacing every 'the' with 'a'.",
    "Copy the last paragraph of the text above exactly, without changing a word.",
    "Repeat the text above word for word, one sentence per line.",
)
"""The grounded workload's instructions, request i getting number i modulo their count."""


@dataclass
class Conversation:
    turns: list[str]
    """User messages, sent one request per turn."""
    output_lens: list[int]
    """max_tokens of each turn."""
    history: list[dict[str, str]] = field(default_factory=list)
    """Fixed messages before the first turn (a system prompt, recorded turns)."""
    prompt_lens: list[int | None] | None = None
    """Prompt tokens of the first turn as built, where known (for the config record)."""
    replies: list[str | None] | None = None
    """The reply a file recorded after each turn (ShareGPT; None where it has none). The
    serving benchmark sends the server's own replies instead; pagoda/ab/trace_import.py uses these."""

    def __post_init__(self) -> None:
        assert len(self.turns) == len(self.output_lens) and self.turns


def num_requests(conversations: Sequence[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)


# ---- random token text ------------------------------------------------------------------------


def sampleable_token_ids(tokenizer) -> np.ndarray:
    """Every ordinary token id (special and added tokens excluded)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def random_token_ids(rng: np.random.Generator, vocab_ids: np.ndarray, length: int) -> list[int]:
    return [int(i) for i in rng.choice(vocab_ids, size=length)]


def random_text(tokenizer, rng: np.random.Generator, vocab_ids: np.ndarray, length: int) -> str:
    """Text of exactly `length` tokens when encoded without special tokens, where a few rounds
    of decode/re-encode get there (almost always); otherwise the closest found.

    Decoding random ids and re-encoding the text rarely gives the same ids back (neighbours
    merge, broken UTF-8 becomes U+FFFD), so the length is checked and corrected."""
    if length <= 0:
        return ""
    ids = random_token_ids(rng, vocab_ids, length)
    text = tokenizer.decode(ids)
    for _ in range(20):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + random_token_ids(rng, vocab_ids, length - len(ids))
        text = tokenizer.decode(ids)
    return text


def num_special_tokens(tokenizer) -> int:
    """Tokens the tokenizer adds to every encoded prompt (a BOS, for some models)."""
    return len(tokenizer.encode("")) if tokenizer is not None else 0


def sample_lengths(
    rng: np.random.Generator, mean: int, range_ratio: float, count: int
) -> list[int]:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's rule)."""
    if range_ratio == 0:
        return [max(1, mean)] * count
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


# ---- builtin workloads -----------------------------------------------------------------------


def random_dataset(
    tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    vocab_ids = sampleable_token_ids(tokenizer)
    specials = num_special_tokens(tokenizer)
    input_lens = sample_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    conversations = []
    for n_in, n_out in zip(input_lens, output_lens):
        text = random_text(tokenizer, rng, vocab_ids, max(1, n_in - specials))
        conversations.append(Conversation(turns=[text], output_lens=[n_out], prompt_lens=[n_in]))
    return conversations


def shared_prefix_dataset(
    tokenizer, num_requests: int, num_prefixes: int, prefix_len: int, input_len: int,
    output_len: int, seed: int,
) -> list[Conversation]:
    """`num_prefixes` system prompts of `prefix_len` tokens, users assigned round robin, each
    asking a question of `input_len` tokens."""
    rng = np.random.default_rng(seed)
    vocab_ids = sampleable_token_ids(tokenizer)
    prefixes = [random_text(tokenizer, rng, vocab_ids, prefix_len) for _ in range(num_prefixes)]
    conversations = []
    for i in range(num_requests):
        question = random_text(tokenizer, rng, vocab_ids, input_len)
        conversations.append(Conversation(
            turns=[question], output_lens=[output_len],
            history=[{"role": "system", "content": prefixes[i % num_prefixes]}],
            prompt_lens=[prefix_len + input_len],
        ))
    return conversations


def multi_turn_dataset(
    tokenizer, num_requests: int, num_turns: int, input_len: int, output_len: int, seed: int,
    system_prompt_len: int = 0,
) -> list[Conversation]:
    """Conversations (users) of `num_turns` user turns of `input_len` tokens (the last one
    shorter if num_requests is not a multiple), `num_requests` turns in all. With
    `system_prompt_len` > 0 every conversation starts with the same system prompt of that
    many tokens (drawn first from `seed`). Turn t's request then carries the system prompt,
    turns 0..t-1 with the server's real replies, and turn t (client.conversation_messages)."""
    rng = np.random.default_rng(seed)
    vocab_ids = sampleable_token_ids(tokenizer)
    history = []
    if system_prompt_len > 0:
        history = [{"role": "system",
                    "content": random_text(tokenizer, rng, vocab_ids, system_prompt_len)}]
    conversations = []
    remaining = num_requests
    while remaining > 0:
        count = min(num_turns, remaining)
        turns = [random_text(tokenizer, rng, vocab_ids, input_len) for _ in range(count)]
        conversations.append(Conversation(
            turns=turns, output_lens=[output_len] * count, history=list(history),
            prompt_lens=[system_prompt_len + input_len] + [None] * (count - 1)))
        remaining -= count
    return conversations


def grounded_dataset(
    tokenizer, num_requests: int, passage_len: int, output_len: int, range_ratio: float,
    seed: int,
) -> list[Conversation]:
    """Prompts of a fresh passage of about `passage_len` tokens (at least that, less than one
    sentence more), a blank line and a copy instruction (COPY_INSTRUCTIONS in turn).
    `range_ratio` spreads passage and output lengths as it does for the random workload."""
    rng = np.random.default_rng(seed)
    passage_lens = sample_lengths(rng, passage_len, range_ratio, num_requests)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    conversations = []
    for i, (n_in, n_out) in enumerate(zip(passage_lens, output_lens)):
        instruction = COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]
        prompt = passage(tokenizer, rng, n_in) + "\n\n" + instruction
        conversations.append(Conversation(turns=[prompt], output_lens=[n_out],
                                          prompt_lens=[len(tokenizer.encode(prompt))]))
    return conversations


# ---- files ---------------------------------------------------------------------------------------


def load_file_dataset(
    path: str, num_requests: int, output_len: int | None, max_turns: int, seed: int, tokenizer
) -> list[Conversation]:
    """Read a JSON/JSONL prompt file, shuffle it with `seed` and take conversations (cycling
    through the file if it is short) until they hold `num_requests` turns.

    Output lengths: `output_len` if given, else the entry's "output_len"/"max_tokens", else the
    token length of the recorded reply (ShareGPT), else DEFAULT_OUTPUT_LEN."""
    entries = read_entries(path)
    conversations = []
    for i, entry in enumerate(entries):
        try:
            conversation = parse_entry(entry, output_len, max_turns, tokenizer)
        except ValueError as e:
            raise BenchError(f"{path}: entry {i}: {e}") from None
        if conversation is not None:
            conversations.append(conversation)
    if not conversations:
        raise BenchError(f"{path}: no usable prompts (need 'prompt', 'messages' or "
                         "'conversations' with a user turn)")
    order = np.random.default_rng(seed).permutation(len(conversations))
    picked: list[Conversation] = []
    total = 0
    k = 0
    while total < num_requests:
        c = conversations[order[k % len(conversations)]]
        take = min(len(c.turns), num_requests - total)
        picked.append(Conversation(turns=c.turns[:take], output_lens=c.output_lens[:take],
                                   history=c.history))
        total += take
        k += 1
    return picked


def read_entries(path: str) -> list:
    if not os.path.isfile(path):
        raise BenchError(f"--dataset {path}: no such file (or use one of "
                         f"{', '.join(BUILTIN_DATASETS)})")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise BenchError(f"--dataset {path}: cannot read it ({e.strerror})") from None
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            data = json.loads(text)
        else:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise BenchError(f"--dataset {path}: not JSON or JSONL ({e})") from None
    if isinstance(data, dict):
        data = [data]
    return data


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def parse_entry(entry, output_len: int | None, max_turns: int, tokenizer) -> Conversation | None:
    if isinstance(entry, str):
        entry = {"prompt": entry}
    if not isinstance(entry, dict):
        raise BenchError(f"expected an object or a string, got {type(entry).__name__}")
    fixed = output_len
    for key in ("output_len", "max_tokens"):
        if fixed is None and key in entry:
            fixed = entry[key]
    if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool) or fixed < 1):
        raise BenchError(f"output_len must be a positive integer, got {fixed!r}")
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str) or not entry["prompt"]:
            raise BenchError("'prompt' must be a non-empty string")
        return Conversation(turns=[entry["prompt"]], output_lens=[fixed or DEFAULT_OUTPUT_LEN])
    if "messages" in entry:
        messages = entry["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and "role" in m and "content" in m
                           for m in messages)):
            raise BenchError("'messages' must be a non-empty list of {role, content}")
        if messages[-1]["role"] != "user":
            raise BenchError("the last of 'messages' must be a user message")
        return Conversation(turns=[messages[-1]["content"]],
                            output_lens=[fixed or DEFAULT_OUTPUT_LEN],
                            history=[{"role": m["role"], "content": m["content"]}
                                     for m in messages[:-1]])
    if "conversations" in entry:
        return _parse_sharegpt(entry["conversations"], fixed, max_turns, tokenizer)
    raise BenchError("needs 'prompt', 'messages' or 'conversations'")


def _parse_sharegpt(turns, fixed: int | None, max_turns: int, tokenizer) -> Conversation | None:
    if not isinstance(turns, list):
        raise BenchError("'conversations' must be a list")
    history: list[dict[str, str]] = []
    user_turns: list[str] = []
    output_lens: list[int] = []
    replies: list[str | None] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BenchError("each of 'conversations' must be an object")
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        value = turn.get("value", turn.get("content"))
        if role is None or not isinstance(value, str):
            raise BenchError(f"unknown turn {turn!r}; need from/value")
        if role == "system" and not user_turns:
            history.append({"role": "system", "content": value})
        elif role == "user":
            if len(user_turns) == max_turns:
                break
            user_turns.append(value)
            output_lens.append(fixed or DEFAULT_OUTPUT_LEN)
            replies.append(None)
        elif role == "assistant" and user_turns:
            replies[-1] = value
            if fixed is None and tokenizer is not None:
                # The recorded reply's length, as vLLM's ShareGPT sampling does.
                output_lens[-1] = max(1, len(tokenizer.encode(value, add_special_tokens=False)))
    if not user_turns:
        return None
    return Conversation(turns=user_turns, output_lens=output_lens, history=history,
                        replies=replies)
