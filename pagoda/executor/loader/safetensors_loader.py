"""Read a Hugging Face model folder: config.json and single or sharded *.safetensors.

A bare decoder stack (a `Qwen3Model` / `MistralModel` saved on its own, as embedding models
such as e5-mistral and Qwen3-Embedding are) stores its tensors without the `model.` prefix
and has no lm_head: its names are read with the prefix added, and without an lm_head the
embedding matrix stands in as the head (embeddings need no head; generated text from such
a checkpoint is meaningless, and the start-up log says so).

A text-and-vision checkpoint whose language model Pagoda runs (TEXT_OF_MULTIMODAL: Llama 4
as Meta publishes it) is read as that language model alone: its text config, its tensors
under the language model's prefix (the prefix dropped), the vision tower's never read.
Images are not supported."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from pagoda.executor.loader.model_files import ModelLoadError

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
STACK_PREFIX = "model."
TEXT_OF_MULTIMODAL = {"Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "language_model.")}
"""Text-and-vision architecture -> (its language model's class, its tensors' prefix)."""


class SafetensorsCheckpoint:
    """A Hugging Face folder; tensors are memory-mapped by safetensors and read one by one."""

    def __init__(self, folder: str) -> None:
        self.path = folder
        try:
            self.hf_config: PretrainedConfig = AutoConfig.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 -- any failure becomes one clear ModelLoadError
            raise ModelLoadError(f"{folder}/config.json: cannot read ({e})") from None
        self.text_prefix = ""
        """The language model's prefix in a text-and-vision checkpoint; other tensors unread."""
        architecture = (getattr(self.hf_config, "architectures", None) or [None])[0]
        if architecture in TEXT_OF_MULTIMODAL:
            text_class, self.text_prefix = TEXT_OF_MULTIMODAL[architecture]
            self.hf_config = self.hf_config.get_text_config()
            self.hf_config.architectures = [text_class]
            logger.info("%s: %s, run as its language model (%s); images are not supported",
                        folder, architecture, text_class)
        self.files = self._weight_files()
        raw_names = self._stored_names()
        self.name_prefix = STACK_PREFIX if is_bare_stack(raw_names) else ""
        """Added to every stored name: `model.` for a bare decoder stack."""
        if (self.name_prefix and "lm_head.weight" not in raw_names
                and not getattr(self.hf_config, "tie_word_embeddings", False)):
            logger.warning("%s: a bare decoder stack without an lm_head (an embedding model): "
                           "the embedding matrix stands in as the head, so generated text is "
                           "meaningless; embeddings are what it serves", folder)
            self.hf_config.tie_word_embeddings = True

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
        return [self._model_name(name) for name in self._stored_names()]

    def _model_name(self, stored: str) -> str:
        """A stored tensor's name as the model's parameters spell it."""
        stored = stored.removeprefix(self.text_prefix)
        return stored if stored.startswith("lm_head.") else self.name_prefix + stored

    def _stored_names(self) -> list[str]:
        """The names of the tensors the model reads (a text-and-vision checkpoint's language
        model's), as stored."""
        names = []
        for file in self.files:
            try:
                with safe_open(file, framework="pt") as handle:
                    stored = handle.keys()  # (a safetensors handle, not a dict)
                names.extend(name for name in stored if name.startswith(self.text_prefix))
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
                stored = handle.keys()  # (a safetensors handle, not a dict)
                keys = [name for name in stored if name.startswith(self.text_prefix)]
                desc = f"Loading {os.path.basename(file)}"
                for name in tqdm(keys, desc=desc, unit="tensor", disable=None):
                    tensor = handle.get_tensor(name)
                    yield self._model_name(name), tensor if dtype is None else tensor.to(dtype)


def is_bare_stack(names: list[str]) -> bool:
    """Tensors of a decoder stack saved without its causal-LM wrapper: `layers.0...` and
    `embed_tokens.weight` where a ...ForCausalLM checkpoint has `model.layers.0...`."""
    return (any(n.startswith(("layers.", "embed_tokens.")) for n in names)
            and not any(n.startswith(STACK_PREFIX) for n in names))
