"""Print a GGUF model's KV-cache bytes per token (every layer's K and V, at DTYPE) and its
context length: what benchmarks/multi_turn_tiers.sh and kv_restart.sh size their pools by.

    python benchmarks/kv_bytes_per_token.py MODEL.gguf [DTYPE]   ->   "46080 8192"
"""

import sys

import torch

from pagoda.executor.kv_cache_allocation import kv_bytes_per_token
from pagoda.executor.loader.gguf_loader import GGUFCheckpoint
from pagoda.executor.loader.model_loader import resolve_dtype

config = GGUFCheckpoint(sys.argv[1]).hf_config
dtype = resolve_dtype(sys.argv[2] if len(sys.argv) > 2 else "auto", torch.device("cpu"))
print(kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                         dtype, "auto"), config.max_position_embeddings)
