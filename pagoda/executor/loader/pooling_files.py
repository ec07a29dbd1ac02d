"""How a model pools its embeddings, read from its files (ModelPooling, pagoda/pooling_params.py).

Where each setting comes from, first found wins:

    pooling     --pooling / LLM(pooling=...)
                sentence-transformers: modules.json names a Pooling module whose folder's
                    config.json sets pooling_mode_lasttoken | _mean_tokens | _cls_token
                GGUF: <arch>.pooling_type (llama.cpp's: 0 none, 1 mean, 2 cls, 3 last)
                last (decoder embedding models: Qwen3-Embedding, e5-mistral, gte-Qwen2)
    normalize   --normalize-embeddings / --no-normalize-embeddings
                sentence-transformers: a Normalize module in modules.json (as vLLM reads it)
                yes
    dimensions  config.json's matryoshka_dimensions (only those) or is_matryoshka (any up to
                the hidden size), or --matryoshka; else refused

A pooling mode Pagoda does not compute (max, mean of sqrt length, weighted mean) fails at
start, naming --pooling as the way out: serving it with another pooling would answer with
vectors that match no other deployment of that model.
"""

from __future__ import annotations

import json
import logging
import os

from pagoda.config import EmbeddingConfig
from pagoda.executor.loader.model_files import ModelFiles, ModelLoadError
from pagoda.pooling_params import ModelPooling

logger = logging.getLogger(__name__)

ST_POOLING_MODULE = "sentence_transformers.models.Pooling"
ST_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_cls_token": "cls"}
ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
"""llama.cpp's LLAMA_POOLING_TYPE_*; 0 (none) and 4 (rank) say nothing of embeddings."""


def model_pooling(config: EmbeddingConfig, files: ModelFiles, hf_config,
                  gguf_pooling: tuple[str, int | None] | None = None) -> ModelPooling:
    """The model's pooling, from the flags, then its files (the table above).
    `gguf_pooling`: a GGUF file's (architecture, <arch>.pooling_type or None); None for a
    Hugging Face folder. ModelLoadError for a sentence-transformers pooling mode Pagoda does
    not compute, unless --pooling overrides it."""
    pooling, source, normalize, problem = None, "default", None, None
    if files.format == "hf":
        pooling, source, normalize, problem = read_sentence_transformers(files.path)
    elif gguf_pooling is not None:
        architecture, value = gguf_pooling
        if value is not None and int(value) in GGUF_POOLING_TYPES:
            pooling, source = GGUF_POOLING_TYPES[int(value)], f"GGUF {architecture}.pooling_type"
    if config.pooling is not None:
        pooling, source = config.pooling, "--pooling"
    elif problem is not None:
        raise ModelLoadError(problem)
    if config.normalize_embeddings is not None:
        normalize = config.normalize_embeddings
    dimensions = tuple(int(d) for d in getattr(hf_config, "matryoshka_dimensions", None) or ())
    return ModelPooling(
        pooling=pooling or "last",
        normalize=True if normalize is None else normalize,
        hidden_size=int(hf_config.hidden_size),
        matryoshka=bool(config.matryoshka or dimensions
                        or getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=() if config.matryoshka else dimensions,
        source=source,
    )


def read_sentence_transformers(folder: str) -> tuple[str | None, str, bool | None, str | None]:
    """(pooling or None, where it came from, normalize or None, a problem or None) from a
    sentence-transformers model folder's modules.json (all None but "default" without one).
    The problem: a pooling mode Pagoda does not compute."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None, "default", None, None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: expected a list of modules")
    modules = [m for m in modules if isinstance(m, dict)]
    normalize = any(m.get("type") == ST_NORMALIZE_MODULE for m in modules)
    pooling_module = next((m for m in modules if m.get("type") == ST_POOLING_MODULE), None)
    if pooling_module is None:
        return None, "default", normalize, None
    config_path = os.path.join(folder, pooling_module.get("path") or "", "config.json")
    if not os.path.isfile(config_path):
        return None, "default", normalize, None
    settings = _read_json(config_path)
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    chosen = [mode for key, mode in ST_POOLING_MODES.items() if settings.get(key)]
    unsupported = [key for key in ST_UNSUPPORTED_MODES if settings.get(key)]
    if unsupported or len(chosen) > 1:
        modes = ", ".join(unsupported + [k for k in ST_POOLING_MODES if settings.get(k)])
        return None, "default", normalize, (
            f"{config_path}: pooling {modes} is not supported (Pagoda pools last, mean or "
            "cls); pass --pooling last|mean|cls to choose one")
    if not chosen:
        return None, "default", normalize, None
    return chosen[0], os.path.relpath(config_path, folder), normalize, None


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None
