"""LoRAModule: an adapter served from the start (`pagoda serve --lora-modules`), as the
server holds it. The flag's values are parsed in pagoda/cli/lora_modules.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None
    """The served model the adapter belongs to; None: the first (`pagoda serve` fills it in
    once the adapter is checked)."""
