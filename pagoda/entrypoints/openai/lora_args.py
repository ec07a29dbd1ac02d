"""`pagoda serve`'s LoRA flags (server_args.py adds them): --lora-modules (adapters served
from the start) and --lora-allowed-paths (where POST /v1/load_lora_adapter may read).

Every adapter given at start is read and checked against its base model's config before
any engine is built (headers only: seconds), so a bad one fails the start at once with one
line and exit code 2 (a LoRAAdapterError is a ValueError: cli/main.py). The engine flags
--enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras come from LoRAConfig
(config_args.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagoda.config import EngineConfig
from pagoda.entrypoints.openai.lora_modules import check_unique_names, parse_lora_module
from pagoda.lora.lora_modules import LoRAModule


def add_lora_args(group) -> None:
    group.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters to serve (needs --enable-lora): name=path (a PEFT "
                            "folder or a GGUF LoRA file), or JSON {\"name\": ..., \"path\": "
                            "..., \"base_model_name\": ...}; a request's `model` names one")
    group.add_argument("--lora-allowed-paths", nargs="+", action="extend", default=None,
                       metavar="DIR",
                       help="directories POST /v1/load_lora_adapter may load adapters from "
                            "(links and '..' resolved first); default: none, loading "
                            "adapters at run time is off")


def base_hf_config(config: EngineConfig) -> Any:
    """The model's Hugging Face config, without loading its weights."""
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.model_loader import open_checkpoint

    return open_checkpoint(resolve_model_files(config.model.model)).hf_config


def served_names(args: argparse.Namespace, configs: list[EngineConfig]) -> list[str]:
    """The names the models will be served as (--served-model-name, else the file name)."""
    if args.served_model_name:
        return list(args.served_model_name)
    from pagoda.executor.loader.model_files import resolve_model_files

    return [resolve_model_files(config.model.model).name for config in configs]


def check_lora_args(args: argparse.Namespace, configs: list[EngineConfig]) -> list[LoRAModule]:
    """The --lora-modules adapters, each checked against its base; ValueError (a
    LoRAAdapterError for an adapter's files) naming the flag and the problem."""
    from pagoda.lora.adapter_checks import check_lora_request
    from pagoda.lora.request import LoRARequest

    for folder in args.lora_allowed_paths or []:
        if not os.path.isdir(os.path.expanduser(folder)):
            raise ValueError(f"--lora-allowed-paths {folder}: no such directory")
    modules = [parse_lora_module(text) for text in args.lora_modules or []]
    if not modules:
        return []
    names = served_names(args, configs)
    check_unique_names(modules, names)
    hf_configs: dict[str, Any] = {}
    for i, module in enumerate(modules):
        base = module.base_model_name or names[0]
        if base not in names:
            raise ValueError(f"--lora-modules {module.name}: base_model_name {base!r} is not "
                             f"a served model ({', '.join(names)})")
        config = configs[names.index(base)]
        if not config.lora.enable_lora:
            raise ValueError(f"--lora-modules {module.name}: LoRA adapters need --enable-lora")
        if base not in hf_configs:
            hf_configs[base] = base_hf_config(config)
        request = LoRARequest(module.name, i + 1, module.path, base)
        try:
            check_lora_request(request, hf_configs[base], config.lora)
        except ValueError as e:
            raise type(e)(f"--lora-modules: {e}") from None
    return [LoRAModule(m.name, m.path, m.base_model_name or names[0]) for m in modules]
