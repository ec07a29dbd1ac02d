"""What one request is as it goes through the serving pipeline (pipeline.py): who it is
served as (ServedAs: the name its response gives, the adapter its engine requests carry),
the sampling values an endpoint adds (SamplingFields), its prompts before validation
(PromptInput), the accepted job (ServingJob), and what a stream remembers of each choice
(ChoiceState). Plain data, no HTTP."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams
from pagoda.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ServedAs:
    """Who one request is served as: the `model` its response names, and the adapter every
    engine request of it carries (None: the base model)."""

    model_name: str
    lora_request: LoRARequest | None = None


@dataclass
class SamplingFields:
    """What an endpoint's request gives SamplingParams beyond the shared fields."""

    max_tokens: int | None
    logprobs: int | None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    """The output constraint (structured_fields.structured_outputs_of); field_names maps
    "structured_outputs" to the request field it came from."""
    field_names: dict[str, str] = field(default_factory=dict)
    """SamplingParams name -> this endpoint's name, where they differ (for errors)."""

    def name_of(self, param: str) -> str:
        return self.field_names.get(param, param)


@dataclass
class PromptInput:
    """One prompt as the endpoint built it, before validation."""

    text: str | None
    token_ids: list[int] | None
    """None: the validation step tokenizes `text`."""
    param: str
    """The request field errors about this prompt name ("prompt", "prompt[1]", "messages")."""


@dataclass
class ServingJob:
    """One accepted request on its way through the pipeline."""

    request: Any
    """The endpoint's protocol request (a SamplingRequestFields)."""
    request_id: str
    params: SamplingParams
    prompts: list[EngineRequest]
    created: int = field(default_factory=lambda: int(time.time()))
    request_state: Any = None
    """The HTTP request's state (raw_request.state), where the usage is left (USAGE_STATE)."""
    served_as: ServedAs | None = None
    """The name and adapter it is served as (set by `validate`)."""

    @property
    def model_name(self) -> str:
        assert self.served_as is not None, "validate sets served_as"
        return self.served_as.model_name

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)


@dataclass
class ChoiceState:
    """What a stream remembers of one choice between chunks; endpoints may extend it."""

    index: int
    finished: bool = False
    num_tokens: int = 0
    """Output tokens so far (for the usage chunk)."""
