"""Public traces as traffic records (TrafficEntry lists, pagoda/traffic_record.py), for
`pagoda bench ab`.

    format    what the file holds                         what each request becomes
    pagoda    a traffic record (--record-traffic)         itself
    sharegpt  ShareGPT conversations (JSON list or JSONL:  one chat request per human turn: the
              {"conversations": [{"from", "value"}]}),    conversation so far (the recorded
              no timing                                   replies) then the turn; max_tokens =
                                                          the recorded reply's tokens
    azure     Azure's LLM inference trace (CSV:            a completion of ContextTokens tokens
              TIMESTAMP,ContextTokens,GeneratedTokens)     of synthetic text, GeneratedTokens out
    mooncake  Mooncake's trace (JSONL: timestamp in ms,    a completion of input_length tokens
              input_length, output_length, hash_ids)       whose text shares a prefix wherever
                                                          the trace's hash_ids do

Arrivals: Azure and Mooncake from their timestamps (the first request at 0.0); ShareGPT from a
Poisson process at `rate` requests per second (`seed`), the conversations interleaved at random
with each one's turns in order. Requests are self-contained (recorded replies, not live ones),
so a replay may send them at these times without waiting for earlier answers.

Synthetic prompts are words of one token each (vocabulary entries like " river": a space then
letters), drawn at random: n words are n tokens under tokenizers that split at spaces, which
a one-off check confirms (else each prompt is re-counted and corrected). The server's count
also holds the tokens its tokenizer adds (a BOS): the text is that much shorter. A Mooncake
prompt is the texts of its hash ids (MOONCAKE_BLOCK_TOKENS each, the same words wherever an id
appears) cut to input_length, or followed by words of its own up to it. Their bodies
ask for every output token the trace saw: max_tokens with ignore_eos and min_tokens, as `bench
serve` does (ShareGPT's only set max_tokens: a real conversation may end sooner). Entries
carry the trace's token counts where it has them; bodies name no model and no `stream`: the
replay sets those.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import re
from collections.abc import Iterator
from datetime import datetime, timezone

import numpy as np

from pagoda.bench import BenchError
from pagoda.bench.client import conversation_messages
from pagoda.bench.datasets import Conversation, num_special_tokens, parse_entry
from pagoda.bench.serve import TrafficConfig, arrival_times
from pagoda.traffic_record import TrafficEntry, read_json_lines, read_traffic

TRACE_FORMATS = ("pagoda", "sharegpt", "azure", "mooncake")

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake's traces (their KV block size)."""

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

_ALL_TURNS = 1 << 30  # parse_entry's max_turns: every turn of a conversation


def load_trace(
    path: str, format: str, tokenizer=None, rate: float = 1.0, seed: int = 0,
    max_requests: int | None = None,
) -> list[TrafficEntry]:
    """The requests of the trace at `path` in arrival order, the first `max_requests` of them
    (None: all). `tokenizer`: the served model's (not needed for "pagoda"); `rate` (requests
    per second, inf: all at once) and `seed` place ShareGPT's arrivals and pick synthetic
    words. BenchError naming the file (and its line or entry) for anything wrong, or
    TrafficRecordError (pagoda/traffic_record.py's, also a ValueError) for a line that is not
    JSON or a recorded entry that is wrong."""
    if format not in TRACE_FORMATS:
        raise BenchError(f"trace format {format!r}: must be one of {', '.join(TRACE_FORMATS)}")
    if max_requests is not None and max_requests < 1:
        raise BenchError(f"max_requests must be >= 1, got {max_requests}")
    if not (rate > 0):
        raise BenchError(f"rate must be a positive number of requests per second (or inf), "
                         f"got {rate}")
    if format == "pagoda":
        return read_traffic(path)[:max_requests]
    if tokenizer is None:
        raise BenchError(f"{path}: a {format} trace needs the model's tokenizer")
    if not os.path.isfile(path):
        raise BenchError(f"{path}: no such file")
    if format == "sharegpt":
        return import_sharegpt(path, tokenizer, rate, seed, max_requests)
    if format == "azure":
        return import_azure(path, tokenizer, seed, max_requests)
    return import_mooncake(path, tokenizer, seed, max_requests)


# ---- ShareGPT --------------------------------------------------------------------------------


def import_sharegpt(
    path: str, tokenizer, rate: float, seed: int, max_requests: int | None
) -> list[TrafficEntry]:
    conversations: list[Conversation] = []
    total = 0
    for label, entry in _sharegpt_entries(path):
        if max_requests is not None and total >= max_requests:
            break
        try:
            conversation = parse_entry(entry, None, _ALL_TURNS, tokenizer)
        except ValueError as e:
            raise BenchError(f"{path}: {label}: {e}") from None
        if conversation is not None:
            conversations.append(conversation)
            total += len(conversation.turns)
    if not conversations:
        raise BenchError(f"{path}: no conversation with a human turn")
    rng = np.random.default_rng(seed)
    owners = np.repeat(np.arange(len(conversations)),
                       [len(c.turns) for c in conversations])
    rng.shuffle(owners)  # interleaved conversations; each one's turns stay in order
    owners = owners[:max_requests]
    arrivals = arrival_times(len(owners), TrafficConfig(request_rate=rate, seed=seed))
    next_turn = [0] * len(conversations)
    entries = []
    for owner, arrival in zip(owners, arrivals):
        conversation, turn = conversations[owner], next_turn[owner]
        next_turn[owner] += 1
        replies = [reply or "" for reply in (conversation.replies or [])[:turn]]
        max_tokens = conversation.output_lens[turn]
        entries.append(TrafficEntry(
            arrival=arrival, endpoint="chat",
            body={"messages": conversation_messages(conversation, turn, replies),
                  "max_tokens": max_tokens},
            output_tokens=max_tokens, source="sharegpt",
        ))
    return entries


def _sharegpt_entries(path: str) -> Iterator[tuple[str, object]]:
    """(where it is, entry) of a JSON list ("entry i") or JSONL file ("line n")."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096).lstrip()
    except OSError as e:
        raise BenchError(f"{path}: cannot read it ({e.strerror})") from None
    if not head.startswith("["):
        yield from ((f"line {number}", entry) for number, entry in read_json_lines(path))
        return
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise BenchError(f"{path}: line {e.lineno}: not JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"{path}: cannot read it ({e})") from None
    yield from ((f"entry {i}", entry) for i, entry in enumerate(data))


# ---- Azure -----------------------------------------------------------------------------------


def import_azure(
    path: str, tokenizer, seed: int, max_requests: int | None
) -> list[TrafficEntry]:
    rows: list[tuple[float, int, int]] = []  # (seconds, context tokens, generated tokens)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            columns = {name.strip().lower(): name for name in reader.fieldnames or []}
            missing = [c for c in AZURE_COLUMNS if c.lower() not in columns]
            if missing:
                raise BenchError(f"{path}: line 1: not an Azure trace header: needs the "
                                 f"columns {','.join(AZURE_COLUMNS)} (missing "
                                 f"{', '.join(missing)})")
            time_key, in_key, out_key = (columns[c.lower()] for c in AZURE_COLUMNS)
            for row in reader:
                if max_requests is not None and len(rows) >= max_requests:
                    break
                where = f"{path}: line {reader.line_num}"
                rows.append((
                    parse_timestamp(row.get(time_key), where),
                    _count(row.get(in_key), AZURE_COLUMNS[1], where),
                    _count(row.get(out_key), AZURE_COLUMNS[2], where),
                ))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise BenchError(f"{path}: cannot read it as CSV ({e})") from None
    if not rows:
        raise BenchError(f"{path}: no rows after the header")
    synth = TextSynthesizer(tokenizer)
    rng = np.random.default_rng(seed)
    start = min(row[0] for row in rows)
    entries = []
    for seconds, context_tokens, generated_tokens in sorted(rows, key=lambda row: row[0]):
        num_tokens = synth.text_tokens(context_tokens)
        prompt = synth.text(synth.random_words(rng, num_tokens), num_tokens, rng)
        entries.append(TrafficEntry(
            arrival=seconds - start, endpoint="completions",
            body=synthetic_body(prompt, generated_tokens),
            prompt_tokens=context_tokens, output_tokens=generated_tokens, source="azure-trace",
        ))
    return entries


_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_timestamp(text: str | None, where: str) -> float:
    """Seconds since the epoch of "2023-11-16 18:15:46.6805900" (Azure's 7 fractional
    digits), any ISO 8601 date-time, or a plain number of seconds; no zone means UTC."""
    text = (text or "").strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(_FRACTION.sub(r"\1", text))
    except ValueError:
        raise BenchError(f"{where}: TIMESTAMP {text!r} is not a date and time like "
                         "2023-11-16 18:15:46.6805900") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _count(value, name: str, where: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise BenchError(f"{where}: {name} must be a whole number of tokens, "
                         f"got {value!r}") from None
    if number < 0:
        raise BenchError(f"{where}: {name} must be >= 0, got {number}")
    return number


# ---- Mooncake --------------------------------------------------------------------------------


def import_mooncake(
    path: str, tokenizer, seed: int, max_requests: int | None
) -> list[TrafficEntry]:
    rows = []  # (ms, input tokens, output tokens, hash ids)
    for number, data in read_json_lines(path):
        if max_requests is not None and len(rows) >= max_requests:
            break
        where = f"{path}: line {number}"
        if not isinstance(data, dict):
            raise BenchError(f"{where}: expected a JSON object, got {type(data).__name__}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in data:
                raise BenchError(f"{where}: missing '{key}'")
        timestamp = data["timestamp"]
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) \
                or not math.isfinite(timestamp):
            raise BenchError(f"{where}: 'timestamp' must be a number of milliseconds, "
                             f"got {timestamp!r}")
        lengths = []
        for key in ("input_length", "output_length"):
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BenchError(f"{where}: '{key}' must be an integer >= 0, got {value!r}")
            lengths.append(value)
        hash_ids = data.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
            raise BenchError(f"{where}: 'hash_ids' must be a list of integers >= 0")
        rows.append((float(timestamp), lengths[0], lengths[1], hash_ids))
    if not rows:
        raise BenchError(f"{path}: no requests")
    synth = TextSynthesizer(tokenizer)
    blocks: dict[int, np.ndarray] = {}

    def block(hash_id: int) -> np.ndarray:
        # The same id gives the same words in every request (and every run with this seed).
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, 0, hash_id])
            blocks[hash_id] = synth.random_words(rng, MOONCAKE_BLOCK_TOKENS)
        return blocks[hash_id]

    start = min(row[0] for row in rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    entries = []
    for i in order:
        ms, input_length, output_length, hash_ids = rows[i]
        num_tokens = synth.text_tokens(input_length)
        needed = math.ceil(num_tokens / MOONCAKE_BLOCK_TOKENS)
        parts = [block(h) for h in hash_ids[:needed]]
        rng = np.random.default_rng([seed, 1, i])  # this request's own words, past its blocks
        have = sum(len(p) for p in parts)
        if have < num_tokens:
            parts.append(synth.random_words(rng, num_tokens - have))
        prompt = synth.text(np.concatenate(parts)[:num_tokens], num_tokens, rng)
        entries.append(TrafficEntry(
            arrival=(ms - start) / 1000.0, endpoint="completions",
            body=synthetic_body(prompt, output_length),
            prompt_tokens=input_length, output_tokens=output_length, source="mooncake",
        ))
    return entries


# ---- synthetic text --------------------------------------------------------------------------


def synthetic_body(prompt: str, output_tokens: int) -> dict:
    max_tokens = max(1, output_tokens)  # the API takes no max_tokens 0
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "min_tokens": max_tokens}


class TextSynthesizer:
    """Text of an asked number of tokens from one-token words (see the module's docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words, self.exact = word_pool(tokenizer)
        self.num_special = num_special_tokens(tokenizer)

    def text_tokens(self, prompt_tokens: int) -> int:
        """Tokens of text for a prompt the server counts as `prompt_tokens` (at least 1)."""
        return max(1, prompt_tokens - self.num_special)

    def random_words(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """Indices of `count` words of the pool."""
        return rng.integers(0, len(self.words), size=count, dtype=np.int32)

    def text(self, words: np.ndarray, num_tokens: int, rng: np.random.Generator) -> str:
        """The words' text; unless the pool is known exact, re-counted and corrected at its
        end (words dropped or drawn from `rng`) until it has `num_tokens` tokens, or as
        close as a few rounds get."""
        text = "".join(self.words[words].tolist())
        if self.exact:
            return text
        words = list(words)
        best, best_error = text, None
        for _ in range(8):
            error = len(self.tokenizer.encode(text, add_special_tokens=False)) - num_tokens
            if best_error is None or abs(error) < abs(best_error):
                best, best_error = text, error
            if error == 0:
                break
            if error > 0:
                words = words[:max(1, len(words) - error)]
            else:
                words += list(self.random_words(rng, -error))
            text = "".join(self.words[np.asarray(words, dtype=np.int64)].tolist())
        return best


MIN_POOL_WORDS = 64
_WORD = re.compile(r"[a-z]{2,}")
_SPACE_MARKS = ("Ġ", "▁", " ")  # how byte-level BPE and SentencePiece vocabularies show a space


@functools.lru_cache(maxsize=4)
def word_pool(tokenizer) -> tuple[np.ndarray, bool]:
    """(words, exact): every vocabulary entry that is a space then 2+ lowercase letters and
    encodes alone as one token; exact when 2000 random ones in a row are 2000 tokens (the
    tokenizer splits at spaces, so any n of them are n tokens)."""
    candidates = []
    for token in tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))):
        if isinstance(token, str) and token[:1] in _SPACE_MARKS and _WORD.fullmatch(token[1:]):
            candidates.append(" " + token[1:])
    if candidates:
        encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"]
        candidates = [word for word, ids in zip(candidates, encoded) if len(ids) == 1]
    if len(candidates) < MIN_POOL_WORDS:
        raise BenchError(f"cannot synthesize prompts for this tokenizer: only "
                         f"{len(candidates)} of its tokens are plain words")
    words = np.array(sorted(set(candidates)))
    sample = np.random.default_rng(0).integers(0, len(words), size=2000)
    text = "".join(words[sample].tolist())
    exact = len(tokenizer.encode(text, add_special_tokens=False)) == len(sample)
    return words, exact
