"""`pagoda env`: the CPU features Pagoda sees, the kernels built for them, and what `auto`
picks (dtype, quantization, attention backend) for a model, without loading its weights."""

from __future__ import annotations

import argparse

from pagoda.config import EngineConfig, ModelConfig
from pagoda.config_args import attribute_docstrings


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", help="print the CPU features seen and the paths auto picks")
    # The two engine options env reads, with the engine's help texts.
    parser.add_argument("--model", default=None,
                        help=attribute_docstrings(ModelConfig)["model"])
    parser.add_argument("--device", default="auto",
                        help=attribute_docstrings(EngineConfig)["device"])
    parser.set_defaults(func=run_env)


def run_env(args: argparse.Namespace) -> int:
    from pagoda.executor.loader.model_files import resolve_model_files

    files = resolve_model_files(args.model)  # a bad --model fails before the slow imports
    from pagoda.executor.attention.cpu_backend import select_backend
    from pagoda.executor.kernels.cpu_info import environment_report
    from pagoda.executor.loader.model_loader import (
        open_checkpoint,
        resolve_device,
        resolve_dtype,
        resolve_quantization,
        set_cpu_threads,
    )
    from pagoda.executor.models.registry import attention_shape, has_latent_attention

    for line in environment_report():
        print(line)
    device = resolve_device(args.device)
    threads = set_cpu_threads() if device.type == "cpu" else None
    checkpoint = open_checkpoint(files)
    config = checkpoint.hf_config
    dtype = resolve_dtype("auto", device)
    quantization = resolve_quantization("auto", checkpoint, device)
    backend = select_backend(16, device, dtype, *attention_shape(config), None,
                             values_in_keys=has_latent_attention(config))
    print(f"auto for {files.path}:")
    print(f"  device {device}{f', {threads} threads' if threads else ''}")
    print(f"  dtype {str(dtype).removeprefix('torch.')}")
    if quantization == "gguf":
        quantization = "the file's own types, packed"
    print(f"  quantization {quantization or 'none'}"
          + (f" ({checkpoint.layer_weight_type()} file)" if quantization else ""))
    print(f"  attention {backend.name}")
    return 0
