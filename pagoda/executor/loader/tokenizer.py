"""Tokenizer, chat template and end-of-sequence ids for a checkpoint.

Hugging Face folders: tokenizer.json + tokenizer_config.json (chat template, special tokens)
and generation_config.json (EOS ids). GGUF files: transformers builds a fast tokenizer from
the GGUF metadata (tokens, merges, special ids, tokenizer.chat_template).
"""

from __future__ import annotations

import functools
import json
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagoda.executor.loader.model_files import ModelFiles, ModelLoadError


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """Build (or reuse, within this process) the tokenizer of a checkpoint."""
    return _load_tokenizer_cached(files.path, files.format, os.path.getmtime(files.path))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str, format: str, mtime: float) -> PreTrainedTokenizerBase:
    # Building a GGUF tokenizer converts the whole vocabulary (seconds): engines created
    # again in one process (tests, benchmarks) share it. Tokenizers are read-only here.
    files = ModelFiles(path=path, format=format)
    try:
        if files.format == "gguf":
            folder, name = os.path.split(os.path.abspath(files.path))
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(files.path)
    except Exception as e:  # noqa: BLE001 -- any failure becomes one clear ModelLoadError
        raise ModelLoadError(f"{files.path}: cannot build a tokenizer ({e})") from None


def eos_token_ids(files: ModelFiles, tokenizer: PreTrainedTokenizerBase, hf_config) -> list[int]:
    """Every id that ends generation: generation_config.json, the config, the tokenizer."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    if files.format == "hf":
        path = os.path.join(files.path, "generation_config.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    add(json.load(f).get("eos_token_id"))
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    add(getattr(hf_config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    return ids
