"""LoRARequest: the adapter a request runs with, as vLLM spells it.

`lora_int_id` is the adapter's identity everywhere past the front end: the scheduler counts
distinct ids per step (--max-loras), the prefix cache hashes it into every block (blocks of
different adapters are never shared), and the runner keys loaded weights by it. The server
gives each adapter a fresh id when it is loaded, so an adapter unloaded and loaded again from
another path never meets the old one's cached blocks or weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest(lora_name, lora_int_id, lora_path)`, positional as in vLLM."""

    lora_name: str
    lora_int_id: int
    """> 0 and unique per adapter among those one engine holds (0 means the base model)."""
    lora_path: str
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file."""
    base_model_name: str | None = None
    """The served model the adapter belongs to (its `parent` in /v1/models); None: the
    engine's one model."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
