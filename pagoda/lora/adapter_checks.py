"""The checks an adapter passes before anything serves it, shared by `pagoda serve`
(--lora-modules at start, POST /v1/load_lora_adapter) and the offline LLM(lora_request=).

- `check_lora_request`: LoRA is on for the engine, and the adapter's files fit its base
  (adapter_files.read_adapter + check_adapter: headers only, no weights read, no torch).
- `resolve_allowed_path`: a path a client gave lies inside a directory the server allows
  (--lora-allowed-paths); both sides go through realpath, so neither `..` nor a symlink can
  lead outside.

Every refusal is a LoRAAdapterError (a ValueError) whose message names the problem and the
flag or keyword that changes it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pagoda.config import LoRAConfig
from pagoda.lora.adapter_files import AdapterFiles, LoRAAdapterError, read_adapter
from pagoda.lora.adapter_fit import check_adapter
from pagoda.lora.request import LoRARequest


def check_lora_enabled(lora_config: LoRAConfig | None, what: str) -> None:
    """`what` (an adapter's name) needs the engine's LoRA on."""
    if lora_config is None or not lora_config.enable_lora:
        raise LoRAAdapterError(
            f"{what}: LoRA adapters are off for this model; start it with --enable-lora "
            "(LLM(..., enable_lora=True) offline)")


def check_lora_request(lora_request: LoRARequest, hf_config: Any,
                       lora_config: LoRAConfig | None) -> AdapterFiles:
    """The adapter's files, read and checked against the base (its HF config) and
    --max-lora-rank; LoRAAdapterError naming the adapter and the problem."""
    what = f"LoRA adapter {lora_request.lora_name!r}"
    check_lora_enabled(lora_config, what)
    try:
        adapter = read_adapter(lora_request.lora_path)
        check_adapter(adapter, hf_config, lora_config.max_lora_rank)
    except LoRAAdapterError as e:
        raise LoRAAdapterError(f"{what}: {e}") from None
    return adapter


def resolve_allowed_path(path: str, allowed_dirs: Sequence[str]) -> str:
    """The real path of `path` when it is one of `allowed_dirs` or lies below one (each of
    them resolved too); LoRAAdapterError otherwise, or when none is allowed."""
    if not allowed_dirs:
        raise LoRAAdapterError(
            "loading LoRA adapters at run time is off: start the server with "
            "--lora-allowed-paths DIR (the directories adapters may be loaded from)")
    real = os.path.realpath(os.path.expanduser(path))
    for folder in allowed_dirs:
        root = os.path.realpath(os.path.expanduser(folder))
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise LoRAAdapterError(
        f"{path}: outside the directories --lora-allowed-paths allows "
        f"({', '.join(allowed_dirs)}), once links and '..' are resolved")
