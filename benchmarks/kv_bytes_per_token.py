"""Print a GGUF model's KV-cache bytes per token (every layer's K and V, at DTYPE) and its
context length: what benchmarks/multi_turn_tiers.sh and kv_restart.sh size their pools by.

    python benchmarks/kv_bytes_per_token.py MODEL.gguf [DTYPE]   ->   "46080 8192"
"""

import argparse

import torch

from pagoda.executor.kv_cache_allocation import kv_bytes_per_token
from pagoda.executor.loader.gguf_loader import GGUFCheckpoint
from pagoda.executor.loader.model_loader import resolve_dtype


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("dtype", nargs="?", default="auto", help="the KV cache's dtype")
    args = parser.parse_args(argv)
    config = GGUFCheckpoint(args.model).hf_config
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    print(kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                             config.head_dim, dtype, "auto"), config.max_position_embeddings)


if __name__ == "__main__":
    main()
