"""Read a Hugging Face model folder: config.json and single or sharded *.safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from pagoda.executor.loader.model_files import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """A Hugging Face folder; tensors are memory-mapped by safetensors and read one by one."""

    def __init__(self, folder: str) -> None:
        self.path = folder
        try:
            self.hf_config: PretrainedConfig = AutoConfig.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 -- any failure becomes one clear ModelLoadError
            raise ModelLoadError(f"{folder}/config.json: cannot read ({e})") from None
        self.files = self._weight_files()

    def _weight_files(self) -> list[str]:
        index_path = os.path.join(self.path, SAFETENSORS_INDEX)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"{index_path}: not a valid safetensors index ({e})") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        files = [os.path.join(self.path, n) for n in names]
        for file in files:
            if not os.path.isfile(file):
                raise ModelLoadError(f"{file}: listed in the index but missing")
        return files

    @property
    def weight_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    def tensor_names(self) -> list[str]:
        """The names iter_weights yields, in its order (read from the files' headers)."""
        names = []
        for file in self.files:
            try:
                with safe_open(file, framework="pt") as handle:
                    names.extend(handle.keys())
            except Exception as e:  # noqa: BLE001 -- as iter_weights
                raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        return names

    def iter_weights(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor in `dtype`; None: as stored) one tensor at a time."""
        for file in self.files:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # noqa: BLE001 -- any failure becomes one clear ModelLoadError
                raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
            with handle:
                keys = list(handle.keys())
                desc = f"Loading {os.path.basename(file)}"
                for name in tqdm(keys, desc=desc, unit="tensor", disable=None):
                    tensor = handle.get_tensor(name)
                    yield name, tensor if dtype is None else tensor.to(dtype)
