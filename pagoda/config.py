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
from pagoda.speculative_config import SpeculativeConfig, parse_speculative_config

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_DTYPES = ("auto", "float32", "bfloat16")
"""`prefill_dtype` values (pagoda/executor/kernels/arithmetic.py)."""
DECODE_ACTIVATIONS = ("auto", "float32", "int16", "int8")
"""`decode_activations` values (pagoda/executor/kernels/arithmetic.py)."""
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
"""`quantization` values: auto (a GGUF file's own types, run packed, where Pagoda's kernels
build: pagoda/executor/loader/model_loader.py), none (None is the same), or a method."""
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""--lora-dtype: the numbers loaded adapters are stored in (auto: the adapter file's own)."""
"""`kv_cache_dtype` values, as vLLM's --kv-cache-dtype (pagoda/executor/attention/kv_quant.py)."""
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
DISTRIBUTED_BACKENDS = ("mp", "ray")
"""`distributed_executor_backend` values: local processes (mp) or actors on a Ray cluster."""
RAY_PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
"""`ray_placement_strategy` values, Ray's placement group strategies."""
PREEMPTION_MODES = ("auto", "recompute", "swap")
"""`preemption_mode` values, vLLM's names (pagoda/engine/core/scheduler.py)."""
DEFAULT_KV_OFFLOAD_DISK_BYTES = 8 << 30
POOLING_CHOICES = ("last", "mean", "cls")
"""`pooling` values (pagoda/pooling_params.py)."""



@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """GGUF file or Hugging Face model folder (config.json + *.safetensors); None: the bundled
    SmolLM2-135M-Instruct."""
    dtype: str = field(default="auto", metadata={"choices": SUPPORTED_DTYPES})
    """Run dtype of weights and activations. auto: bfloat16 on CUDA, float32 on every CPU
    (measured fastest there in prefill and decode; see BENCHMARKS.md)."""
    max_model_len: int | None = None
    """Longest prompt plus output, in tokens; None means the model's context length."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from the model (a HF folder or a GGUF file)."""
    seed: int = 0
    """Seed for requests that give none (keeps runs reproducible)."""
    quantization: str | None = field(default="auto", metadata={"choices": QUANTIZATION_CHOICES})
    """Weight-only quantized linear layers, CPU only (activations stay in the run dtype), in
    groups of 32: int4 (Q4_1's form; on a Q4_1 GGUF model its own 4-bit weights) or int8
    (Q8_0's form); the logits head then runs int8. none (or None): weights in the run dtype
    (a GGUF file dequantized). auto: a GGUF file's own quantized types (Q4_0 ... Q6_K), run
    packed by Pagoda's CPU kernels wherever they build, else none; for an AWQ or GPTQ folder
    (4-bit, zero points) its own 4-bit weights, run packed (auto or int4 only); `pagoda env`
    shows the choice."""
    prefill_dtype: str = field(default="auto", metadata={"choices": PREFILL_DTYPES})
    """Arithmetic of large batches (prefill chunks of 128 tokens or more) over quantized
    weights, CPU: float32, or bfloat16 (inputs and weights rounded to bf16, sums in float32:
    AMX's rate where the CPU has it). auto: bfloat16 where it measures at least 1.5x
    float32's rate on this CPU at start and dtype is auto (or bfloat16), else float32; an
    explicit --dtype float32 keeps float32 everywhere."""
    decode_activations: str = field(default="auto", metadata={"choices": DECODE_ACTIVATIONS})
    """Arithmetic of small batches (decode steps) over quantized weights, CPU: float32, or
    activations quantized per 32 inputs for integer dot products (VNNI / AVX2 / ARM):
    int16 (two 8-bit parts: ~2e-5 relative error, float32's tokens) or int8 (llama.cpp's
    arithmetic: ~0.5 %, faster with several rows). auto: int16 where one row through the
    model's weights measures at least 1.1x float32's rate at start and dtype is auto, else
    float32; an explicit
    --dtype float32 keeps float32 everywhere."""
    compile: bool = False
    """torch.compile the model and warm it up at start (runner_builder.compile_model): faster
    decode steps, but up to a minute of compiling per step shape first (3 shapes, 4 with
    quantized weights); BENCHMARKS.md has the measurements."""
    deterministic: bool = False
    """Batch-invariant execution: an identical request gives bit-identical logits, and so the
    same greedy tokens, whatever batch it lands in, however its prompt is chunked and
    whatever the prefix cache holds. Every token is computed on its own (row-wise matmul,
    norm and activation kernels; each token's attention by the paged kernel; no whole-stack
    decode step), at a cost in speed that BENCHMARKS.md measures. CPU, float32 activations,
    the Llama family (Llama, Mistral, Qwen2/3, Phi-3, SmolLM) with a float32 KV cache."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.deterministic and self.dtype not in ("auto", "float32"):
            raise ValueError(f"deterministic runs float32 activations; got dtype {self.dtype!r} "
                             "(use dtype auto or float32)")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {', '.join(PREFILL_DTYPES)}, "
                             f"got {self.prefill_dtype!r}")
        if self.decode_activations not in DECODE_ACTIVATIONS:
            raise ValueError(f"decode_activations must be one of {', '.join(DECODE_ACTIVATIONS)}"
                             f", got {self.decode_activations!r}")
        if self.deterministic and (self.prefill_dtype == "bfloat16"
                                   or self.decode_activations in ("int8", "int16")):
            raise ValueError("deterministic runs float32 arithmetic; drop prefill_dtype "
                             "bfloat16 and decode_activations int8 / int16")
        if self.deterministic and self.compile:
            raise ValueError("deterministic runs the eager model; drop compile")
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
    """KV cache storage: auto (the run dtype); float16 or bfloat16 under float32 activations
    (half the bytes decode reads deep into a long context; llama.cpp's default is float16);
    or 8 bits a value with one scale per token and KV head, about twice the tokens of a 16-bit
    cache (4x float32) in the same memory: int8, fp8_e4m3 (fp8 is the same) or fp8_e5m2. All
    but auto are CPU only; BENCHMARKS.md has their fidelity."""
    kv_offload_memory: int = 0
    """Bytes of host memory for a second KV tier (0: off): prefix blocks evicted from the KV
    cache are kept here, keyed by their prefix hash, and loaded back instead of recomputed
    when a prompt with that prefix returns; --preemption-mode swap keeps preempted requests'
    blocks here too. Models with one full-attention KV group only (no sliding window)."""
    kv_offload_dir: str | None = None
    """Folder of a disk KV tier (None: off) below the host tier: blocks the host tier evicts
    go here, checksummed and tagged with a fingerprint of the model, dtypes and block size;
    it survives a restart (a graceful shutdown writes the KV cache's prefix blocks here)."""
    kv_offload_disk_bytes: int = DEFAULT_KV_OFFLOAD_DISK_BYTES
    """Most bytes the disk KV tier holds (least recently used entries go first)."""

    @property
    def kv_offload_enabled(self) -> bool:
        """Whether a host or disk KV tier is configured."""
        return self.kv_offload_memory > 0 or self.kv_offload_dir is not None

    def __post_init__(self) -> None:
        if type(self.kv_offload_memory) is not int or self.kv_offload_memory < 0:
            raise ValueError(f"kv_offload_memory must be an int >= 0 bytes, got "
                             f"{self.kv_offload_memory!r}")
        if type(self.kv_offload_disk_bytes) is not int or self.kv_offload_disk_bytes < 1:
            raise ValueError(f"kv_offload_disk_bytes must be an int >= 1 bytes, got "
                             f"{self.kv_offload_disk_bytes!r}")
        if self.kv_offload_dir is not None and not self.kv_offload_dir.strip():
            raise ValueError("kv_offload_dir must name a folder (or be None: no disk tier)")
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
    preemption_mode: str = field(default="auto", metadata={"choices": PREEMPTION_MODES})
    """What a request preempted for lack of KV blocks loses: recompute (its blocks are freed
    and its tokens computed again when it resumes) or swap (its blocks are copied to the
    host KV tier, --kv-offload-memory, and loaded back when it resumes; recompute when the
    tier has no room). auto: swap where there is a host tier (measured 1.3x the throughput
    of recompute, BENCHMARKS.md section 34), else recompute."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
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
class ParallelConfig:
    """How the engine spreads over processes (pagoda/executor/parallel/ for tensor
    parallelism, pagoda/engine/data_parallel/ for replicas)."""

    tensor_parallel_size: int = 1
    """Processes one model is split across (Megatron-style: attention heads, MLP and vocabulary
    divided between them, one all-reduce after attention and one after the MLP per layer)."""
    data_parallel_size: int = 1
    """Engine replicas (processes) behind one server, each a whole copy of the model; a
    router spreads requests by outstanding work and prefix-cache affinity."""
    distributed_executor_backend: str = field(default="mp",
                                              metadata={"choices": DISTRIBUTED_BACKENDS})
    """mp: workers are local processes (no extra install); ray: workers and replicas are Ray
    actors on the running Ray cluster (pip install pagoda-llm[ray]; `ray start --head`)."""
    ray_placement_strategy: str = field(default="PACK",
                                        metadata={"choices": RAY_PLACEMENT_STRATEGIES})
    """Ray only: how the placement group puts one engine's workers on the cluster's nodes:
    PACK (on as few nodes as fit), STRICT_PACK (one node), SPREAD, STRICT_SPREAD (each on
    its own node)."""
    ray_cpus_per_worker: int = 1
    """Ray only: CPUs each worker reserves on its node, and the threads it runs."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if type(self.ray_cpus_per_worker) is not int or self.ray_cpus_per_worker < 1:
            raise ValueError(f"ray_cpus_per_worker must be an int >= 1, got "
                             f"{self.ray_cpus_per_worker!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement_strategy must be one of "
                             f"{', '.join(RAY_PLACEMENT_STRATEGIES)}, got "
                             f"{self.ray_placement_strategy!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")


@dataclass(frozen=True)
class EmbeddingConfig:
    """How embedding requests (POST /v1/embeddings, LLM.embed) pool the model's final hidden
    states (pagoda/pooling_params.py); each None takes the model's own files."""

    pooling: str | None = field(default=None, metadata={"choices": POOLING_CHOICES})
    """Embedding pooling: last (the last token's hidden state), mean (over the prompt) or
    cls (the first token's). None: the model's sentence-transformers files (modules.json,
    1_Pooling/config.json) or GGUF pooling_type, else last (decoder embedding models)."""
    normalize_embeddings: bool | None = None
    """L2-normalise embeddings. None: as the model's sentence-transformers files say (a
    Normalize module), else yes (vLLM's default)."""
    matryoshka: bool = False
    """Allow `dimensions` on embedding requests (Matryoshka truncation, then renormalising)
    for any size up to the hidden size, though the model's config.json does not declare
    is_matryoshka or matryoshka_dimensions."""

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be None or one of {', '.join(POOLING_CHOICES)}, "
                             f"got {self.pooling!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters over the base model (pagoda/lora/, pagoda/executor/lora/):
    vLLM's flags and defaults."""

    enable_lora: bool = False
    """Serve LoRA adapters: requests may name one (a server's `model`, LLM.generate's
    lora_request); off, the model runs without the adapter hooks at all."""
    max_loras: int = 1
    """Distinct adapters in one step (requests of others wait for a later step)."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted; a larger one is refused at load."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in memory, least recently used dropped first; None: max_loras.
    At least max_loras."""
    lora_dtype: str = field(default="auto", metadata={"choices": LORA_DTYPES})
    """The numbers a loaded adapter is stored in: auto keeps the adapter file's own
    (float32, bfloat16, float16; a quantized GGUF adapter becomes float32), so an adapter
    holds its file's size; the products are float32 for float32 activations whatever the
    storage."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, "
                             f"got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")

    @property
    def max_loaded(self) -> int:
        """Adapters kept loaded (max_cpu_loras, defaulting to max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    speculative_config: str | None = None
    """Speculative decoding as a JSON object, vLLM's keys: {"method": "ngram" | "draft_model",
    "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": n, "model":
    draft path, "adaptive": true}; None: off. LLM() also takes a dict."""
    speculative: SpeculativeConfig | None = field(init=False, default=None, repr=False)
    """speculative_config parsed and checked (set in __post_init__; not an option)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", parse_speculative_config(self.speculative_config))
        if self.model.compile and self.lora.enable_lora:
            raise ValueError("compile and enable_lora cannot be combined (the adapters are "
                             "added by forward hooks the compiled graph would not run); "
                             "drop --compile")
        if self.scheduler.preemption_mode == "auto":
            object.__setattr__(self.scheduler, "preemption_mode",
                               "swap" if self.cache.kv_offload_memory > 0 else "recompute")
        if self.scheduler.preemption_mode == "swap" and self.cache.kv_offload_memory <= 0:
            raise ValueError("preemption_mode swap keeps preempted requests' KV blocks in the "
                             "host KV tier: give it memory with --kv-offload-memory BYTES")
        if self.cache.kv_offload_enabled and self.parallel.tensor_parallel_size > 1:
            raise ValueError("the KV tiers (kv_offload_memory, kv_offload_dir) run with "
                             "tensor_parallel_size 1 only for now")
        if self.cache.kv_offload_dir is not None and self.parallel.data_parallel_size > 1:
            raise ValueError("kv_offload_dir with data_parallel_size > 1: the replicas would "
                             "share one disk KV tier; use one engine, or host tiers alone "
                             "(--kv-offload-memory)")
        if self.model.deterministic and self.cache.kv_cache_dtype != "auto":
            raise ValueError(f"deterministic runs a float32 KV cache; got kv_cache_dtype "
                             f"{self.cache.kv_cache_dtype!r} (use auto)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     repeatable: tuple[str, ...] = ()) -> None:
        """Add the "engine" argument group: one `--field-name` flag per field of every section
        (those named in `repeatable` may be given more than once: a list)."""
        add_config_args(parser, cls, "engine",
                        "the engine's options; each is also an LLM(...) keyword of the same name",
                        repeatable)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config from arguments parsed with add_cli_args (absent ones keep defaults)."""
        return config_from_namespace(cls, args)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """The config from flat keywords (`max_num_seqs=8`); TypeError for an unknown one."""
        return config_from_kwargs(cls, kwargs)
