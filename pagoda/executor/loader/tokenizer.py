"""Tokenizer, chat template and end-of-sequence ids for a checkpoint.

Hugging Face folders: tokenizer.json + tokenizer_config.json (chat template, special tokens)
and generation_config.json (EOS ids). GGUF files: transformers builds a fast tokenizer from
the GGUF metadata (tokens, merges, special ids, tokenizer.chat_template), whatever the file's
architecture (AutoTokenizer where transformers' GGUF reader knows it, else the generic fast
tokenizer from the same keys). That conversion
parses the file's metadata twice and converts the whole vocabulary (~4 s for a 49k-token
vocabulary on one core), so its result is saved as a Hugging Face folder under
$PAGODA_TOKENIZER_CACHE (else ~/.cache/pagoda/tokenizers), keyed by the file's real path,
size and modification time and the transformers and tokenizers versions: a later process
on the same file loads the folder instead (~0.3 s). The cache keeps the MAX_CACHE_ENTRIES
newest entries (a few MB each). An empty $PAGODA_TOKENIZER_CACHE turns it off; a cache that
cannot be written or read is skipped, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagoda.executor.loader.model_files import ModelFiles, ModelLoadError

logger = logging.getLogger(__name__)

TOKENIZER_CACHE_ENV = "PAGODA_TOKENIZER_CACHE"
DEFAULT_TOKENIZER_CACHE = os.path.join("~", ".cache", "pagoda", "tokenizers")
MAX_CACHE_ENTRIES = 32


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """Build (or reuse, within this process) the tokenizer of a checkpoint."""
    return _load_tokenizer_cached(files.path, files.format, os.path.getmtime(files.path))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str, format: str, mtime: float) -> PreTrainedTokenizerBase:
    # Engines created again in one process (tests, benchmarks) share the tokenizer: it is
    # read-only here.
    try:
        if format == "gguf":
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- any failure becomes one clear ModelLoadError
        raise ModelLoadError(f"{path}: cannot build a tokenizer ({e})") from None


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The GGUF file's tokenizer, from the disk cache when an entry for this file is there."""
    cached = gguf_tokenizer_cache_folder(path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(cached)
            os.utime(cached)  # the pruning below keeps the most recently used entries
            return tokenizer
        except Exception as e:  # noqa: BLE001 -- a damaged entry is rebuilt below
            logger.warning("tokenizer cache entry %s unreadable (%s): rebuilding it", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError:
        # AutoTokenizer reads the file's model config first, and refuses the architectures
        # transformers' GGUF reader does not know (olmoe, deepseek2, glm4moe, ...); the
        # tokenizer itself depends only on the file's tokenizer.* keys, which the generic
        # fast tokenizer converts alike (its failure, if it fails too, is the one raised)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    if cached is not None:
        _save_entry(tokenizer, cached)
    return tokenizer


def gguf_tokenizer_cache_folder(path: str) -> str | None:
    """Where the cache keeps this GGUF file's tokenizer, or None with the cache off."""
    root = os.environ.get(TOKENIZER_CACHE_ENV, DEFAULT_TOKENIZER_CACHE)
    if not root:
        return None
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = "\0".join((real, str(stat.st_size), str(stat.st_mtime_ns),
                     transformers.__version__, tokenizers.__version__))
    return os.path.join(os.path.expanduser(root), hashlib.sha256(key.encode()).hexdigest()[:32])


def _save_entry(tokenizer: PreTrainedTokenizerBase, folder: str) -> None:
    """Write the entry whole or not at all: into a temporary folder, then renamed into place
    (a second process writing the same entry at once loses the rename, harmlessly); then
    drop the oldest entries past MAX_CACHE_ENTRIES."""
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    except OSError as e:
        logger.info("tokenizer cache %s not writable (%s): not cached", parent, e)
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, folder)
    except OSError as e:
        logger.info("tokenizer cache entry %s not written (%s)", folder, e)
        shutil.rmtree(staging, ignore_errors=True)
        return
    try:  # another process may prune at the same time: a vanished entry is skipped
        entries = [e for e in os.scandir(parent) if not e.name.startswith(".")]
        entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in entries[MAX_CACHE_ENTRIES:]:
        shutil.rmtree(old.path, ignore_errors=True)


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
