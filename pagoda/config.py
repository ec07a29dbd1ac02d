"""Engine configuration: a few frozen dataclasses, one per concern, validated on creation.

Values computed at run time (the number of KV blocks, the model's architecture config read
from the checkpoint) live on the objects that compute them, not here.

These classes are the single source of the engine's options: each field's docstring is its
`--help` text, and pagoda/config_args.py turns every field into a CLI flag (`--max-num-seqs`)
and an `LLM(max_num_seqs=...)` keyword. Adding a field with a docstring here adds both.
Field names are unique across the sections (checked).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pagoda.config_args import add_config_args, config_from_kwargs, config_from_namespace

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""`kv_cache_dtype` values, as vLLM's --kv-cache-dtype (pagoda/executor/attention/kv_quant.py)."""
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
"""`quantization` values: auto (int4 for a Q4_1 GGUF model where Pagoda's kernel runs it,
see pagoda/executor/loader/model_loader.py), none (None is the same), or a method."""


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """GGUF file or Hugging Face model folder (config.json + *.safetensors); None: the bundled
    SmolLM2-135M-Instruct."""
    dtype: str = field(default="auto", metadata={"choices": SUPPORTED_DTYPES})
    """Run dtype of weights and activations. auto: bfloat16 on CUDA and on CPUs with native
    bf16, else float32."""
    max_model_len: int | None = None
    """Longest prompt plus output, in tokens; None means the model's context length."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from the model (a HF folder or a GGUF file)."""
    seed: int = 0
    """Seed for requests that give none (keeps runs reproducible)."""
    quantization: str | None = field(default="auto", metadata={"choices": QUANTIZATION_CHOICES})
    """Weight-only quantized linear layers, CPU only (activations stay in the run dtype), in
    groups of 32: int4 (Q4_1's form; on a Q4_1 GGUF model its own 4-bit weights) or int8
    (Q8_0's form); the logits head then runs int8. none (or None): weights in the run dtype.
    auto: int4 for a Q4_1 GGUF model wherever Pagoda's CPU kernels build (float32, or bfloat16
    with AVX-512 BF16), else none; for an AWQ or GPTQ folder (4-bit, zero points) its own
    4-bit weights, run packed (auto or int4 only); `pagoda env` shows the choice."""
    compile: bool = False
    """torch.compile the model and warm it up at start (ModelRunner.compile_model): faster
    decode steps, but up to a minute of compiling per step shape first (3 shapes, 4 with
    quantized weights); BENCHMARKS.md has the measurements."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
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
    """Tokens per KV-cache block (a power of two)."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache on CPU; None: 256 MiB (or one max_model_len sequence if more),
    at most a fifth of free RAM and no more than max_num_seqs x max_model_len tokens."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV cache)."""
    enable_prefix_caching: bool = field(
        default=True, metadata={"aliases": ("--no-prefix-caching",)})
    """Automatic prefix caching: reuse the KV blocks of identical prompt prefixes across
    requests."""
    num_kv_blocks: int | None = None
    """Force the number of KV blocks instead of sizing the cache from memory (tests and
    experiments)."""
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    """KV cache storage: auto (the run dtype), or 8 bits a value with one scale per token and
    KV head, about twice the tokens of a 16-bit cache (4x float32) in the same memory: int8,
    fp8_e4m3 (fp8 is the same) or fp8_e5m2. CPU only; BENCHMARKS.md has their fidelity."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        # vLLM's alias, stored under the name the executor uses
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_ALIASES.get(self.kv_cache_dtype,
                                                                        self.kv_cache_dtype))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decodes)."""
    max_num_seqs: int = 128
    """Most requests running at once (in one batch)."""
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES})
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add the "engine" argument group: one `--field-name` flag per field of every section."""
        add_config_args(parser, cls, "engine",
                        "the engine's options; each is also an LLM(...) keyword of the same name")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config from arguments parsed with add_cli_args (absent ones keep defaults)."""
        return config_from_namespace(cls, args)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """The config from flat keywords (`max_num_seqs=8`); TypeError for an unknown one."""
        return config_from_kwargs(cls, kwargs)
