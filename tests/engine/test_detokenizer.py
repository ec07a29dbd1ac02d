"""IncrementalDetokenizer on the bundled SmolLM2 tokenizer (byte-level BPE).

The oracle is one `tokenizer.decode` of all output ids: streaming token by token must add
up to exactly that text, never show U+FFFD for a character split over tokens, and never
show text that a stop string later removes.
"""

from __future__ import annotations

import pytest

from pagoda.engine.core.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.tokenizer import load_tokenizer
from tests.executor.test_tokenizer import TEXTS

REPLACEMENT_CHAR = "\ufffd"
CHAT_PROMPT = "<|im_start|>user\nSay something 🙂<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf):
    return load_tokenizer(resolve_model_files(bundled_gguf))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(CHAT_PROMPT)


def stream(
    detok: IncrementalDetokenizer, output_ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time like the engine does; returns the deltas and the stop."""
    deltas: list[str] = []
    stop = None
    for start in range(0, len(output_ids), chunk):
        stop = detok.update(output_ids[start : start + chunk])
        if stop is not None:
            break
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, stop


def test_prompt_context_is_cut_mid_character(tokenizer):
    """The emoji prompt below is long enough that the detokenizer's window starts inside it."""
    ids = tokenizer.encode("👨\u200d👩\u200d👧\u200d👦")
    assert len(ids) > PROMPT_CONTEXT_TOKENS
    assert tokenizer.decode(ids[-PROMPT_CONTEXT_TOKENS:]).startswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    "prompt", [CHAT_PROMPT, "", "👨\u200d👩\u200d👧\u200d👦"], ids=["chat", "empty", "emoji"]
)
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tokenizer, text, prompt, chunk):
    prompt_ids = tokenizer.encode(prompt) if prompt else []
    output_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, stop = stream(detok, output_ids, chunk)
    expected = tokenizer.decode(output_ids, skip_special_tokens=True)
    assert stop is None
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    for delta in deltas:
        assert REPLACEMENT_CHAR not in delta


def test_streaming_covers_split_characters(tokenizer):
    """Guard for the test above: some of the texts do split characters over tokens."""
    num_split = sum(
        any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in tokenizer.encode(text))
        for text in TEXTS
    )
    assert num_split >= 8


def test_split_character_is_held_until_complete(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("a🦄b")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    texts = []
    for token_id in output_ids:
        detok.update([token_id])
        texts.append(detok.take_delta(finished=False))
    partial = [i for i in output_ids if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert partial  # the unicorn's bytes span several tokens
    assert "".join(texts) == "a🦄b"
    assert any("🦄" in t for t in texts)  # emitted whole, once its last byte arrived
    assert all(REPLACEMENT_CHAR not in t for t in texts)


def test_skip_special_tokens(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Sure, here it is.<|im_end|>")
    assert output_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    deltas, _ = stream(kept, output_ids)
    assert "".join(deltas) == "Sure, here it is.<|im_end|>"
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas, _ = stream(skipped, output_ids)
    assert "".join(deltas) == "Sure, here it is."


# --- stop strings ------------------------------------------------------------------------

STOP_TEXT = "The answer is forty-two. Done thinking; the end."


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_across_tokens(tokenizer, prompt_ids, chunk):
    output_ids = tokenizer.encode(STOP_TEXT)
    stop = "forty-two"
    assert not any(stop in t for t in token_texts(tokenizer, output_ids))  # it spans tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[stop])
    deltas, found = stream(detok, output_ids, chunk)
    assert found == stop
    assert detok.stop_string == stop
    assert "".join(deltas) == "The answer is "
    assert detok.output_text == "The answer is "


def test_stop_string_reported_on_the_token_that_completes_it(tokenizer, prompt_ids):
    output_ids = tokenizer.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["forty-two"])
    for n, token_id in enumerate(output_ids, start=1):
        if detok.update([token_id]) is not None:
            break
    assert "forty-two" in tokenizer.decode(output_ids[:n])
    assert "forty-two" not in tokenizer.decode(output_ids[: n - 1])


def test_stop_string_included_in_output(tokenizer, prompt_ids):
    output_ids = tokenizer.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(
        tokenizer, prompt_ids, stop=["forty-two"], include_stop_str_in_output=True
    )
    deltas, found = stream(detok, output_ids)
    assert found == "forty-two"
    assert "".join(deltas) == "The answer is forty-two"


def test_stop_string_inside_one_token_truncates_mid_token(tokenizer, prompt_ids):
    output_ids = tokenizer.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["swer"])
    deltas, found = stream(detok, output_ids)
    assert found == "swer"
    assert "".join(deltas) == "The an"


def test_multibyte_stop_string(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("mood: 😀🦄 great")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["🦄"])
    deltas, found = stream(detok, output_ids)
    assert found == "🦄"
    assert "".join(deltas) == "mood: 😀"
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 100])
@pytest.mark.parametrize(
    "stops", [["Done", "forty"], ["forty", "Done"], ["the end", "answer", "Done"]]
)
def test_earliest_stop_string_wins(tokenizer, prompt_ids, stops, chunk):
    output_ids = tokenizer.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops)
    deltas, found = stream(detok, output_ids, chunk)
    earliest = min(stops, key=STOP_TEXT.find)
    assert found == earliest
    assert "".join(deltas) == STOP_TEXT[: STOP_TEXT.find(earliest)]


def test_earliest_start_wins_when_two_complete_together(tokenizer, prompt_ids):
    """Both stops end inside the same update: the one that starts first is the stop."""
    output_ids = tokenizer.encode("xx alpha beta gamma")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["beta gamma", "alpha beta gam"])
    deltas, found = stream(detok, output_ids, chunk=len(output_ids))
    assert found == "alpha beta gam"
    assert "".join(deltas) == "xx "


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "text, stop",
    [
        # "STOP" starts several times before the real "STOP!".
        ("S ST STO STOP no, STOP? not yet... STOP! trailing", "STOP!"),
        ("abc abcd abcde abcdef end", "abcdef"),
        ("你好你好世界你好世", "你好世界"),
        ("never stops at all, sorry", "XYZZY"),
    ],
)
def test_streamed_text_is_never_taken_back(tokenizer, prompt_ids, text, stop, include):
    """Each delta only extends the final text: a stop-string prefix is held back, not sent
    and then cut, while text that turns out not to be a stop is released."""
    output_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer, prompt_ids, stop=[stop], include_stop_str_in_output=include
    )
    streamed = ""
    snapshots = []
    found = None
    for token_id in output_ids:
        found = detok.update([token_id])
        if found is not None:
            break
        streamed += detok.take_delta(finished=False)
        snapshots.append((streamed, detok.output_text))
    streamed += detok.take_delta(finished=True)
    if stop in text:
        assert found == stop
        end = text.find(stop) + (len(stop) if include else 0)
        assert streamed == text[:end]
    else:
        assert found is None
        assert streamed == text
    holdback = 0 if include else len(stop) - 1
    for partial, output_text in snapshots:
        assert streamed.startswith(partial)  # nothing sent was later removed
        # Held-back text is at most a possible stop prefix, never more.
        assert len(output_text) - len(partial) <= holdback


def test_held_back_text_is_released_when_not_a_stop(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("I say STO")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOP"])
    streamed = ""
    for token_id in output_ids:
        assert detok.update([token_id]) is None
        streamed += detok.take_delta(finished=False)
    assert "STO" not in streamed  # might still become "STOP"
    more = tokenizer.encode("RE closed")
    for token_id in more:
        assert detok.update([token_id]) is None
        streamed += detok.take_delta(finished=False)
    streamed += detok.take_delta(finished=True)
    assert streamed == "I say STORE closed"


def test_no_text_after_a_stop(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("alpha STOP beta")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOP"])
    deltas, found = stream(detok, output_ids)
    assert found == "STOP"
    assert "".join(deltas) == "alpha "
    assert detok.take_delta(finished=True) == ""
