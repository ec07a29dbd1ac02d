"""The offline Python API: `LLM(model=...).generate(prompts)`, `.chat(conversations)` and
`.embed(prompts)`; each takes `lora_request=` (a LoRARequest for all prompts, or one per
prompt, None for the base model) when the LLM was made with enable_lora=True."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

from tqdm import tqdm

from pagoda.config import EngineConfig
from pagoda.engine.loop.builder import build_engine
from pagoda.entrypoints.chat_template import Message, encode_chat_prompt, template_kwargs_of
from pagoda.entrypoints.tools.rendering import render_chat
from pagoda.lora.adapter_checks import check_lora_request
from pagoda.lora.request import LoRARequest
from pagoda.outputs import EmbeddingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches. All requests of one call run together, continuously
    batched; results come back in the order of the prompts."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        """`model`: a GGUF file or Hugging Face folder (None: the bundled model). The keywords
        are the fields of pagoda.config's dataclasses, by name (`dtype="float32"`,
        `max_num_seqs=8`, ...), the same options as the CLI's engine flags; an unknown one
        raises TypeError listing the valid ones. `speculative_config` may be a dict."""
        if isinstance(engine_kwargs.get("speculative_config"), dict):
            engine_kwargs["speculative_config"] = json.dumps(engine_kwargs["speculative_config"])
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        if config.parallel.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={config.parallel.data_parallel_size}: data parallelism "
                "(engine replicas behind one server) is for `pagoda serve "
                "--data-parallel-size N`; the offline LLM runs one engine, so leave it at 1 "
                "(or run one LLM per process)")
        self.config = config
        self.engine = build_engine(config)
        self._request_counter = itertools.count()
        self._loras: dict[int, LoRARequest] = {}
        """The adapters requests ran with, by lora_int_id (each checked once)."""

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self):
        """The LLMEngine (vLLM's name for it): add_lora / remove_lora / list_loras, ..."""
        return self.engine

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids). One SamplingParams for all, or one each;
        `lora_request`: the adapter for all, or one each (None: the base model). A bad
        adapter raises LoRAAdapterError (a ValueError) naming the problem."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        return self._generate([(p, None) for p in prompts], params, use_tqdm, priority,
                              lora_request)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in order: the model's final hidden
        states pooled as it pools (last token, mean or CLS: LLM(pooling=...) or its files),
        normalised unless told otherwise. `pooling_params`: one for all or one each
        (`dimensions` where the model allows Matryoshka truncation)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        outputs = self._generate([(p, None) for p in prompts], params, use_tqdm,
                                 lora_request=lora_request)
        return [EmbeddingRequestOutput.from_request_output(output) for output in outputs]

    def _generate(self, prompts, params, use_tqdm, priority=None,
                  lora_request=None) -> list[RequestOutput]:
        """prompts: (text or token ids, token ids or None) pairs; ids win when given.
        params: SamplingParams, or PoolingParams for pooling requests."""
        loras = self._lora_requests(lora_request, len(prompts))
        request_ids = []
        try:
            for i, ((prompt, prompt_token_ids), p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._request_counter))
                self.engine.add_request(
                    request_id, prompt, p, priority=0 if priority is None else priority[i],
                    prompt_token_ids=prompt_token_ids, lora_request=loras[i],
                )
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def _lora_requests(self, lora_request, num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked once against the model: LoRA on,
        its files fit the base (adapter_checks.py), its lora_int_id not another adapter's."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"got {len(loras)} lora_request for {num_prompts} prompts")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
            if lora is None or self._loras.get(lora.lora_int_id) == lora:
                continue
            known = self._loras.get(lora.lora_int_id)
            if known is not None:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is already the adapter "
                    f"{known.lora_name!r} ({known.lora_path}); give {lora.lora_name!r} an id "
                    "of its own")
            check_lora_request(lora, self.engine.hf_config, self.config.lora)
            self._loras[lora.lora_int_id] = lora
        return loras

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        `tools` (OpenAI's function tools) and messages with `tool_calls` or the `tool` role
        are rendered as the server renders them: through the template if it knows tools,
        else in the Hermes format (pagoda/entrypoints/tools/rendering.py). The output is
        the model's text; the server's --tool-call-parser turns it into calls.
        `chat_template_kwargs` are template variables (`{"enable_thinking": False}` for
        Qwen3); `continue_final_message` continues the last message instead of closing it
        (with add_generation_prompt False), as the server's fields of those names do.
        `lora_request` as for generate (one for all conversations, or one each)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        template_kwargs = template_kwargs_of(chat_template_kwargs,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
        prompts = []
        for conv in conversations:
            text = render_chat(tokenizer, conv, tools, chat_template, add_generation_prompt,
                               template_kwargs=template_kwargs)
            prompts.append((text, encode_chat_prompt(tokenizer, text)))
        return self._generate(prompts, _per_prompt(sampling_params, len(prompts)), use_tqdm,
                              lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """The finished outputs, in order. RequestFailedError, once the others are done,
        when the engine stopped some for a fault of their own (non-finite logits)."""
        finished: dict[str, RequestOutput] = {}
        failed: dict[str, str] = {}
        pending = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                  disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
                for request_id, reason in self.engine.take_failed_requests().items():
                    if request_id in pending:  # stopped by the engine: no further output
                        failed[request_id] = reason
                        pending.discard(request_id)
                        bar.update(1)
        outputs = [finished.get(i) for i in request_ids]
        if failed:
            raise RequestFailedError(failed, outputs)
        return outputs


class RequestFailedError(RuntimeError):
    """Some requests of a generate() / chat() call failed on their own (`failed`: request id
    -> reason); `outputs` holds every request's output in order, None for the failed ones."""

    def __init__(self, failed: dict[str, str], outputs: list[RequestOutput | None]) -> None:
        reasons = "; ".join(f"request {rid}: {reason}" for rid, reason in failed.items())
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed: {reasons}")
        self.failed, self.outputs = failed, outputs


def _per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return params
