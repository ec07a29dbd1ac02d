"""Pagoda: an LLM inference and serving engine.

`LLM` loads lazily (it imports torch): `import pagoda.engine.core.scheduler` and the other
pure-Python modules stay importable without it.
"""

from pagoda.lora.request import LoRARequest
from pagoda.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "LoRARequest", "PoolingParams",
           "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
