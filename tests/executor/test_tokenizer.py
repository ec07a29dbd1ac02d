"""Tokenizer loading, chat templates and EOS ids on the bundled SmolLM2 GGUF.

The GGUF-derived tokenizer is checked three ways: against the vocabulary stored in the GGUF
file itself (read with the `gguf` package), against a reference built separately by
transformers from the same file, and after a round trip through a Hugging Face folder loaded
by our own `load_tokenizer`. Building a tokenizer from GGUF takes seconds, so each is built
once per module.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from pagoda.entrypoints.chat_template import apply_chat_template
from pagoda.executor.loader.model_files import ModelLoadError, resolve_model_files
from pagoda.executor.loader.tokenizer import eos_token_ids, load_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "  leading and trailing spaces  ",
    "runs   of    spaces\tand\t\ttabs\nnew\n\n\nlines\r\nand CRLF",
    "你好，世界！今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 텍스트입니다",
    "emoji 😀🎉🚀 and more 🦄",
    "ZWJ family 👨\u200d👩\u200d👧\u200d👦, coder 👩🏽\u200d💻, flag 🇯🇵",
    "Café crème brûlée, naïve façade, Ångström, São Paulo",
    "combining: e\u0301 a\u0300 n\u0303 Z\u0351\u0346a\u0310l\u0315g\u0360o",
    'def f(x):\n    return {"a": [x ** 2, x // 3]}  # comment\n',
    "3.14159 1,234,567 -42 1e-10 0x1F 2024-06-01 007",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "text<|endoftext|>more text<|im_end|>",
    "∑ x² ≤ ∞ → ∀ε>0 ∃δ, ½ ⅓ ™ ©",
    "مرحبا بالعالم and שלום עולם",
    "Привет, мир! Γειά σου Κόσμε",
    "สวัสดีครับ नमस्ते दुनिया",
    "https://example.com/a?b=c&d=e#frag “quotes” ‘single’ … «guillemets»",
    "Hello , world . It 's n't ?",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 你好 😀"},
    {"role": "assistant", "content": "Hello.\nHow can I help?"},
    {"role": "user", "content": "Say  two\twords."},
]

EXPECTED_CONVERSATION_PROMPT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi! 你好 😀<|im_end|>\n"
    "<|im_start|>assistant\nHello.\nHow can I help?<|im_end|>\n"
    "<|im_start|>user\nSay  two\twords.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def gguf_files(bundled_gguf):
    files = resolve_model_files(bundled_gguf)
    assert files.format == "gguf"
    return files


@pytest.fixture(scope="module")
def tokenizer(gguf_files):
    return load_tokenizer(gguf_files)


@pytest.fixture(scope="module")
def reference(bundled_gguf):
    folder, name = os.path.split(os.path.abspath(bundled_gguf))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def write_hf_folder(folder, generation_config: dict | None = None) -> None:
    """The least a folder needs for resolve_model_files to call it format 'hf'."""
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, f)
    with open(os.path.join(folder, "model.safetensors"), "wb"):
        pass  # never read: only the tokenizer is loaded from this folder
    if generation_config is not None:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)


@pytest.fixture(scope="module")
def hf_folder(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save_pretrained(folder)
    write_hf_folder(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_folder):
    files = resolve_model_files(hf_folder)
    assert files.format == "hf"
    return load_tokenizer(files)


# --- vocabulary and special tokens -------------------------------------------------------


def test_vocabulary_matches_gguf_metadata(bundled_gguf, tokenizer):
    import gguf

    reader = gguf.GGUFReader(bundled_gguf)
    field = reader.fields["tokenizer.ggml.tokens"]
    gguf_tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert len(gguf_tokens) == 49152
    assert len(tokenizer) == len(gguf_tokens)
    assert tokenizer.convert_ids_to_tokens(list(range(len(gguf_tokens)))) == gguf_tokens

    def scalar(key: str) -> int:
        return int(reader.fields[key].contents())

    assert tokenizer.eos_token_id == scalar("tokenizer.ggml.eos_token_id") == 2
    assert tokenizer.bos_token_id == scalar("tokenizer.ggml.bos_token_id") == 1
    assert tokenizer.chat_template == reader.fields["tokenizer.chat_template"].contents()


def test_special_tokens(tokenizer, hf_tokenizer):
    for tok in (tokenizer, hf_tokenizer):
        assert tok.convert_tokens_to_ids("<|im_start|>") == 1
        assert tok.convert_tokens_to_ids("<|im_end|>") == 2
        assert tok.eos_token == "<|im_end|>"
        # Special-token text in a prompt is one id, not characters.
        assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
        assert tok.encode("a<|im_end|>", add_special_tokens=False)[-1] == 2
        # No BOS is added (the GGUF says add_bos_token = False).
        assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


# --- encode / decode ---------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_reference_and_hf_folder(text, tokenizer, reference, hf_tokenizer):
    ids = tokenizer.encode(text)
    assert ids, text
    assert ids == reference.encode(text)
    assert ids == hf_tokenizer.encode(text)
    decoded = tokenizer.decode(ids)
    assert decoded == text  # lossless round trip
    assert decoded == reference.decode(ids) == hf_tokenizer.decode(ids)
    skipped = tokenizer.decode(ids, skip_special_tokens=True)
    assert skipped == reference.decode(ids, skip_special_tokens=True)
    assert skipped == hf_tokenizer.decode(ids, skip_special_tokens=True)
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert special not in skipped


def test_texts_reach_specials_byte_tokens_and_whitespace_runs(tokenizer):
    """TEXTS is worth its round trips only if it exercises the tokenizer's hard cases: special
    markers parsed as single ids, characters with no piece of their own (byte-level
    fallback: a single token decodes to a partial character), and merged whitespace runs."""
    encoded = [tokenizer.encode(text) for text in TEXTS]
    assert len({tuple(ids) for ids in encoded}) == len(TEXTS)  # no case repeats another
    pieces = {token_id: tokenizer.decode([token_id]) for ids in encoded for token_id in ids}
    specials = {tokenizer.convert_tokens_to_ids(t)
                for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert specials <= set(pieces)
    assert any("\ufffd" in piece for piece in pieces.values())
    assert any(len(piece) > 1 and not piece.strip() for piece in pieces.values())


def test_batch_encode_matches_reference(tokenizer, reference):
    assert tokenizer(TEXTS)["input_ids"] == reference(TEXTS)["input_ids"]


def test_multibyte_text_uses_byte_tokens(tokenizer):
    """An emoji is several byte-level tokens whose single decodes are partial characters."""
    ids = tokenizer.encode("🦄")
    assert len(ids) > 1
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert tokenizer.decode(ids) == "🦄"


# --- chat templates ----------------------------------------------------------------------


def test_chat_prompt_matches_reference(tokenizer, reference, hf_tokenizer):
    prompt = apply_chat_template(tokenizer, CONVERSATION)
    assert prompt == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert prompt == apply_chat_template(hf_tokenizer, CONVERSATION)
    assert prompt == EXPECTED_CONVERSATION_PROMPT
    assert prompt.endswith("<|im_start|>assistant\n")
    # The rendered prompt tokenizes the same everywhere, special markers as single ids.
    ids = tokenizer.encode(prompt)
    assert ids == reference.encode(prompt) == hf_tokenizer.encode(prompt)
    assert ids.count(1) == 5 and ids.count(2) == 4


def test_chat_prompt_without_generation_prompt(tokenizer, reference, hf_tokenizer):
    prompt = apply_chat_template(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert prompt == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=False
    )
    assert prompt == apply_chat_template(hf_tokenizer, CONVERSATION, add_generation_prompt=False)
    assert prompt == EXPECTED_CONVERSATION_PROMPT.removesuffix("<|im_start|>assistant\n")


def test_chat_prompt_default_system_message(tokenizer, reference, hf_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = apply_chat_template(tokenizer, messages)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt == apply_chat_template(hf_tokenizer, messages)


def test_chat_template_override(tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    prompt = apply_chat_template(tokenizer, CONVERSATION[:2], chat_template=template)
    assert prompt == "[system]You are terse.[user]Hi! 你好 😀"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user"}],
        [{"role": "system", "content": "x"}, {"role": "user"}],
        [{"content": "no role"}],
        ["not a dict"],
        {"role": "user", "content": "not a list"},
    ],
    ids=["empty", "no-content", "second-no-content", "no-role", "not-dict", "not-list"],
)
def test_chat_template_rejects_malformed_messages(tokenizer, messages):
    with pytest.raises(ValueError):
        apply_chat_template(tokenizer, messages)


def test_chat_template_missing_template():
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(no_template, [{"role": "user", "content": "hi"}])


# --- EOS ids -----------------------------------------------------------------------------


def test_eos_ids_for_bundled_gguf(gguf_files, tokenizer):
    ids = eos_token_ids(gguf_files, tokenizer, None)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert len(ids) == len(set(ids))
    # The model config's EOS is added too, without duplicates.
    ids = eos_token_ids(gguf_files, tokenizer, SimpleNamespace(eos_token_id=[2, 0]))
    assert sorted(ids) == [0, 2]


def test_eos_ids_from_generation_config(tokenizer, tmp_path):
    write_hf_folder(tmp_path, generation_config={"eos_token_id": [0, 1]})
    files = resolve_model_files(str(tmp_path))
    assert files.format == "hf"
    ids = eos_token_ids(files, tokenizer, SimpleNamespace(eos_token_id=2))
    assert set(ids) == {0, 1, 2}
    assert len(ids) == 3


def test_eos_ids_from_scalar_generation_config(tokenizer, tmp_path):
    write_hf_folder(tmp_path, generation_config={"eos_token_id": 7})
    ids = eos_token_ids(resolve_model_files(str(tmp_path)), tokenizer, None)
    assert set(ids) == {7, 2}


def test_eos_ids_bad_generation_config(tokenizer, tmp_path):
    write_hf_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        eos_token_ids(resolve_model_files(str(tmp_path)), tokenizer, None)


def test_load_tokenizer_error_names_the_path(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)  # right magic, truncated header
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_tokenizer(resolve_model_files(str(bad)))
