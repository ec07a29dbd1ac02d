"""Engine configuration: a few frozen dataclasses, one per concern, validated on creation.

Values computed at run time (the number of KV blocks, the model's architecture config read
from the checkpoint) live on the objects that compute them, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
"""`quantization` values: auto (int4 for a Q4_1 GGUF model where Pagoda's kernel runs it,
see pagoda/executor/loader/model_loader.py), none (None is the same), or a method."""


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Path to a GGUF file or a Hugging Face model folder; None means the bundled model."""
    dtype: str = "auto"
    """Run dtype of weights and activations: auto, float32, bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest prompt plus output, in tokens; None means the model's context length."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from the model (a HF folder or a GGUF file)."""
    seed: int = 0
    """Seed for requests that give none (keeps runs reproducible)."""
    quantization: str | None = "auto"
    """auto, none/None (weights in the run dtype), int8 or int4: weight-only quantized linear
    layers, CPU only (see pagoda/executor/layers/quantization.py). auto keeps a Q4_1 GGUF
    model's own 4-bit weights (int4) wherever Pagoda's CPU kernels run the run dtype."""
    compile: bool = False
    """torch.compile the model at start, with a warm-up (ModelRunner.compile_model): faster
    steps, a slower start (about a minute per compiled step shape on a 2-core CPU)."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be None or one of {', '.join(QUANTIZATION_CHOICES)}, "
                f"got {self.quantization!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache on CPU; None: 256 MiB (or one max_model_len sequence if more),
    at most a fifth of free RAM and no more than max_num_seqs x max_model_len tokens."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV cache)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    num_gpu_blocks_override: int | None = None
    """Force the number of KV blocks (tests and experiments)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_blocks override must be >= 1, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decodes)."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    policy: str = "fcfs"
    """fcfs: first come first served; priority: lower `priority` value runs first."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps to fit the token budget."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
