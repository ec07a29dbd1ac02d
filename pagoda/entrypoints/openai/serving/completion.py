"""POST /v1/completions: prompts as text or token ids, echo, legacy logprobs, streaming.

What completions supply to the serving pipeline (serving/pipeline.py): one engine request per
prompt (choice `i * n + j` is choice j of prompt i, as OpenAI numbers them), the echoed
prompt in front of a choice's first text, and OpenAI's legacy logprobs shape. Output
constraints (response_format, guided_*, structured_outputs) are taken as chat takes them
(structured_fields.py). vLLM's `prompt_logprobs` (on each choice) and
`return_tokens_as_token_ids` are vllm_extras.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.entrypoints.openai.protocol.requests import CompletionRequest
from pagoda.entrypoints.openai.protocol.responses import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
)
from pagoda.entrypoints.openai.protocol.structured_fields import structured_outputs_of
from pagoda.entrypoints.openai.serving.job import (
    ChoiceState,
    PromptInput,
    SamplingFields,
    ServingJob,
)
from pagoda.entrypoints.openai.serving.pipeline import ServingPipeline, clamp_logprob
from pagoda.entrypoints.openai.serving.vllm_extras import prompt_logprobs_json, token_label
from pagoda.outputs import CompletionOutput, RequestOutput, TokenLogprobDict


@dataclass
class CompletionChoiceState(ChoiceState):
    echoed: bool = False
    """The prompt went out (with the first chunk that had output) or needs not go."""
    text_offset: int = 0
    """Legacy logprobs: where the next token starts in the choice's text."""


class OpenAIServingCompletion(ServingPipeline):
    request_id_prefix = "cmpl"
    response_type = CompletionResponse
    chunk_type = CompletionResponse
    choice_state_type = CompletionChoiceState

    # ---- what completions supply to the pipeline ---------------------------------------------

    def sampling_fields(self, request: CompletionRequest) -> SamplingFields:
        # Echo with logprobs returns the prompt's logprobs too; the engine computes the
        # most alternatives either asks for, and each shape keeps its own number.
        asked = [request.prompt_logprobs, request.logprobs if request.echo else None]
        prompt_logprobs = max((n for n in asked if n is not None), default=None)
        structured_outputs, structured_param = structured_outputs_of(request)
        max_tokens = request.max_tokens
        if "max_tokens" not in request.model_fields_set and self.default_max_tokens is not None:
            max_tokens = None  # the server's default (the pipeline's) replaces OpenAI's 16
        return SamplingFields(
            max_tokens, request.logprobs, prompt_logprobs, structured_outputs,
            field_names={"structured_outputs": structured_param},
        )

    def build_prompts(self, request: CompletionRequest) -> list[PromptInput]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [PromptInput(prompt, None, "prompt")]
        if isinstance(prompt[0], int):
            return [PromptInput(None, list(prompt), "prompt")]
        names = ["prompt"] if len(prompt) == 1 else [f"prompt[{i}]" for i in range(len(prompt))]
        if isinstance(prompt[0], str):
            return [PromptInput(text, None, name) for text, name in zip(prompt, names)]
        return [PromptInput(None, list(ids), name) for ids, name in zip(prompt, names)]

    def response_choice(
        self, job: ServingJob, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput, index: int,
    ) -> CompletionResponseChoice:
        text, token_ids = completion.text, completion.token_ids
        logprob_dicts = completion.logprobs or []
        if job.request.echo:
            prompt = job.prompts[prompt_index]
            text = self.prompt_text(prompt) + text
            token_ids = prompt.prompt_token_ids + token_ids
            logprob_dicts = self.prompt_logprobs(output, prompt) + logprob_dicts
        logprobs = None
        if job.params.logprobs is not None:
            logprobs, _ = self.logprobs(job, token_ids, logprob_dicts, 0)
        extras = {}
        if job.request.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs_json(
                output, len(job.prompts[prompt_index].prompt_token_ids),
                job.request.prompt_logprobs)
        return CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            **extras,
        )

    def stream_choice(
        self, job: ServingJob, state: CompletionChoiceState, prompt_index: int,
        output: RequestOutput, completion: CompletionOutput,
    ) -> CompletionResponseChoice | None:
        text, token_ids = completion.delta_text, completion.delta_token_ids
        logprob_dicts = completion.delta_logprobs or []
        if job.request.echo and not state.echoed:
            if not completion.token_ids and not completion.finished:
                return None  # prompt logprobs are complete with the first token
            state.echoed = True
            prompt = job.prompts[prompt_index]
            text = self.prompt_text(prompt) + text
            token_ids = prompt.prompt_token_ids + token_ids
            logprob_dicts = self.prompt_logprobs(output, prompt) + logprob_dicts
        if not text and not token_ids and not completion.finished:
            return None
        logprobs = None
        if job.params.logprobs is not None:
            logprobs, state.text_offset = self.logprobs(job, token_ids, logprob_dicts,
                                                        state.text_offset)
        return CompletionResponseChoice(
            index=state.index, text=text, logprobs=logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        )

    # ---- echo and logprobs -------------------------------------------------------------------

    def prompt_text(self, prompt: EngineRequest) -> str:
        """The prompt as the request gave it, or its token ids decoded."""
        if prompt.prompt is not None:
            return prompt.prompt
        return self.tokenizer.decode(prompt.prompt_token_ids)

    @staticmethod
    def prompt_logprobs(
        output: RequestOutput, prompt: EngineRequest
    ) -> list[TokenLogprobDict | None]:
        """One entry per prompt token (None where there is none, as for the first token)."""
        logprobs = list(output.prompt_logprobs or [])
        return logprobs + [None] * (len(prompt.prompt_token_ids) - len(logprobs))

    def logprobs(
        self, job: ServingJob, token_ids: list[int],
        logprob_dicts: list[TokenLogprobDict | None], text_offset: int,
    ) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy shape; returns it and the text offset after its last token.

        `top_logprobs` holds the sampled token and the requested alternatives (so up to
        logprobs + 1 entries, as OpenAI documents); a prompt's first token has no logprob.
        With return_tokens_as_token_ids the tokens read "token_id:N"; the offsets still
        count the text's characters."""
        num_top = job.request.logprobs or 0
        as_ids = bool(job.request.return_tokens_as_token_ids)
        decode = self.tokenizer.decode
        result = CompletionLogProbs()
        for token_id, position in zip(token_ids, logprob_dicts):
            if position is None:
                text = decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen_id = token_id if token_id in position else next(iter(position))
                chosen = position[chosen_id]
                text = token_label(chosen_id, chosen, False, decode)
                result.token_logprobs.append(clamp_logprob(chosen.logprob))
                result.top_logprobs.append({
                    token_label(alt_id, lp, as_ids, decode): clamp_logprob(lp.logprob)
                    for alt_id, lp in position.items()
                    if alt_id == chosen_id or (lp.rank is not None and lp.rank <= num_top)
                })
            result.tokens.append(token_label(token_id, None, True) if as_ids else text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result, text_offset
