"""A tiny Hugging Face tokenizer built in memory, with reasoning markers as Qwen3 and the
DeepSeek-R1 distills have them: one byte-level token per byte (no merges), EOS `<|end|>`,
and `<think>` / `</think>` as single added tokens that are not special to Hugging Face (so
the detokenized text carries them) but that llguidance takes for special tokens (as it
takes every `<...>` added token). For the reasoning tests: no download, built in
milliseconds."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|end|>"


def thinking_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS)
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False)
                          for marker in ("<think>", "</think>")])
    tokenizer.chat_template = chat_template
    return tokenizer


def spelled(tokenizer, text: str) -> list[int]:
    """`text`'s byte tokens, even where an added token would match (a model that spells a
    marker out instead of using its token)."""
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False) \
        .pre_tokenize_str(text)
    return [vocab[ch] for piece, _ in pieces for ch in piece]
