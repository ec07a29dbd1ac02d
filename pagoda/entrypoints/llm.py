"""The offline Python API: `LLM(model=...).generate(prompts)` and `.chat(conversations)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from pagoda.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """An engine for offline batches. All requests of one call run together, continuously
    batched; results come back in the order of the prompts."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str | None = "auto",
        compile: bool = False,
        max_model_len: int | None = None,
        tokenizer: str | None = None,
        seed: int = 0,
        device: str = "auto",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        scheduling_policy: str = "fcfs",
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                              tokenizer=tokenizer, seed=seed, quantization=quantization,
                              compile=compile),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              num_gpu_blocks_override=num_kv_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs, policy=scheduling_policy),
            device=device,
        )
        self.engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids). One SamplingParams for all, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        return self._generate([(p, None) for p in prompts], params, use_tqdm, priority)

    def _generate(self, prompts, params, use_tqdm, priority=None) -> list[RequestOutput]:
        """prompts: (text or token ids, token ids or None) pairs; ids win when given."""
        request_ids = []
        try:
            for i, ((prompt, prompt_token_ids), p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._request_counter))
                self.engine.add_request(
                    request_id, prompt, p, priority=0 if priority is None else priority[i],
                    prompt_token_ids=prompt_token_ids,
                )
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            text = apply_chat_template(tokenizer, conv, chat_template, add_generation_prompt)
            prompts.append((text, encode_chat_prompt(tokenizer, text)))
        return self._generate(prompts, _per_prompt(sampling_params, len(prompts)), use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                  disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        return [finished[i] for i in request_ids]


def apply_chat_template(
    tokenizer, messages: list[Message], chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation to the prompt text; ValueError for a malformed conversation."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; pass one with --chat-template")
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt. The template already placed every special token
    (BOS included, where the model has one), so the tokenizer must not add its own."""
    return tokenizer.encode(text, add_special_tokens=False)


def _per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return params
