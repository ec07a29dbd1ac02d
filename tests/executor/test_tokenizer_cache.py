"""The GGUF tokenizer's disk cache (pagoda/executor/loader/tokenizer.py): a later process on
the same file loads the saved folder instead of converting the GGUF again, and what it loads
tokenizes, decodes and templates exactly as transformers' own GGUF tokenizer does. A changed
file, a damaged entry and an unwritable cache each still give the right tokenizer."""

from __future__ import annotations

import os
import shutil

import pytest
from transformers import AutoTokenizer

from pagoda.executor.loader import tokenizer as tokenizer_module
from pagoda.executor.loader.tokenizer import TOKENIZER_CACHE_ENV, gguf_tokenizer_cache_folder
from tests.executor.test_tokenizer import CONVERSATION, TEXTS
from tests.executor.tiny_checkpoints import bundled_tokenizer


@pytest.fixture(scope="module")
def reference():
    return bundled_tokenizer()


def assert_same_tokenizer(tok, reference) -> None:
    assert len(tok) == len(reference)
    for text in TEXTS:
        ids = reference.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == reference.decode(ids)
    for generation_prompt in (True, False):
        assert tok.apply_chat_template(CONVERSATION, tokenize=False,
                                       add_generation_prompt=generation_prompt) == \
            reference.apply_chat_template(CONVERSATION, tokenize=False,
                                          add_generation_prompt=generation_prompt)
    assert (tok.bos_token_id, tok.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tok.all_special_tokens == reference.all_special_tokens


def tokenizer_calls(monkeypatch) -> list[tuple[str, dict]]:
    """Record every AutoTokenizer.from_pretrained call the loader makes, then make it."""
    calls: list[tuple[str, dict]] = []
    real = AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        calls.append((str(path), kwargs))
        return real(path, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", spy)
    return calls


@pytest.mark.slow  # one conversion of the 49k-token vocabulary (seconds)
def test_a_second_load_reads_the_cache_and_tokenizes_the_same(bundled_gguf, reference,
                                                               tmp_path, monkeypatch):
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(tmp_path))
    calls = tokenizer_calls(monkeypatch)
    built = tokenizer_module._gguf_tokenizer(bundled_gguf)
    entry = gguf_tokenizer_cache_folder(bundled_gguf)
    assert os.path.dirname(entry) == str(tmp_path)
    assert os.path.isfile(os.path.join(entry, "tokenizer.json"))
    assert [kw.get("gguf_file") for _, kw in calls] == [os.path.basename(bundled_gguf)]

    calls.clear()
    loaded = tokenizer_module._gguf_tokenizer(bundled_gguf)
    assert calls == [(entry, {})]  # the saved folder, no GGUF conversion
    assert_same_tokenizer(built, reference)
    assert_same_tokenizer(loaded, reference)


@pytest.mark.slow  # two conversions (seconds each)
def test_changed_file_damaged_entry_and_unwritable_cache(bundled_gguf, reference, tmp_path,
                                                         monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(cache))
    copy = tmp_path / "model.gguf"
    shutil.copy2(bundled_gguf, copy)
    first = gguf_tokenizer_cache_folder(str(copy))
    os.utime(copy, ns=(1, 1))  # the same bytes, rewritten: a new entry
    assert gguf_tokenizer_cache_folder(str(copy)) != first

    entry = gguf_tokenizer_cache_folder(str(copy))
    os.makedirs(entry)
    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{ not json")
    assert_same_tokenizer(tokenizer_module._gguf_tokenizer(str(copy)), reference)
    assert_same_tokenizer(AutoTokenizer.from_pretrained(entry), reference)  # rewritten whole

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(blocker / "cache"))  # cannot be created
    assert_same_tokenizer(tokenizer_module._gguf_tokenizer(str(copy)), reference)


def test_the_cache_can_be_turned_off(bundled_gguf, monkeypatch):
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, "")
    assert gguf_tokenizer_cache_folder(bundled_gguf) is None


def test_only_the_newest_entries_are_kept(reference, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "MAX_CACHE_ENTRIES", 2)
    for n, name in enumerate(("oldest", "older")):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (n + 1, n + 1))
    tokenizer_module._save_entry(reference, str(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path)) == ["new", "older"]
    assert os.path.isfile(tmp_path / "new" / "tokenizer.json")
