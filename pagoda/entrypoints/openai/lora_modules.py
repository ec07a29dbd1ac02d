"""`--lora-modules` values, as vLLM takes them: `name=path`, or a JSON object
`{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name optional: the served
model the adapter belongs to, default the first), parsed into the LoRAModule the server
holds (pagoda/lora/lora_modules.py)."""

from __future__ import annotations

import json

from pagoda.lora.lora_modules import LoRAModule


def parse_lora_module(text: str) -> LoRAModule:
    """One --lora-modules value; ValueError naming the value and the forms it may take."""
    usage = ("give name=path or a JSON object {\"name\": ..., \"path\": ..., "
             "\"base_model_name\": ...}")
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e.msg}); {usage}") \
                from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown key(s) {unknown}; {usage}")
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path) or not (
                base is None or isinstance(base, str) and base):
            raise ValueError(f"--lora-modules {text!r}: name and path must be non-empty "
                             f"strings (base_model_name too, when given); {usage}")
        return LoRAModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: {usage}")
    return LoRAModule(name.strip(), path.strip())


def check_unique_names(modules: list[LoRAModule], model_names: list[str]) -> None:
    """Adapter names differ from each other and from the served models' names."""
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        if module.name in model_names:
            raise ValueError(f"--lora-modules: {module.name!r} is the name of a served model; "
                             "give the adapter another name")
        seen.add(module.name)
