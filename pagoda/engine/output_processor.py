"""Turns sampled token ids into RequestOutputs: detokenized text, stop strings, logprobs.

A request with n > 1 runs as n child requests (ids `"{index}_{parent id}"`) that share their
prompt blocks through the prefix cache; this module folds them back into one RequestOutput
whose `outputs` holds one CompletionOutput per child, in index order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.request import Request
from pagoda.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobDict,
    TokenLogprobs,
)
from pagoda.sampling_params import SamplingParams


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[ChildState] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobDict | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.completion.finished for c in self.children)


@dataclass
class ChildState:
    parent: ParentState
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}
        self.updated: dict[str, ParentState] = {}
        """Parents with news since the last make_outputs (so a step touches only those)."""

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, child_ids: list[str], arrival_time: float,
    ) -> None:
        parent = ParentState(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        for index, child_id in enumerate(child_ids):
            completion = CompletionOutput(
                index=index,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
            child = ChildState(parent, completion, detokenizer)
            parent.children.append(child)
            parent.child_ids.append(child_id)
            self.children[child_id] = child
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        return list(parent.child_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def _logprob_dicts(self, logprobs: TokenLogprobs) -> list[TokenLogprobDict]:
        result = []
        for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks):
            position: TokenLogprobDict = {
                ids[0]: Logprob(values[0], rank, self.tokenizer.decode([ids[0]]))
            }
            for top_rank, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
                position.setdefault(
                    token_id, Logprob(value, top_rank, self.tokenizer.decode([token_id]))
                )
            result.append(position)
        return result

    def add_prompt_logprobs(self, request_id: str, logprobs: TokenLogprobs) -> None:
        child = self.children.get(request_id)
        if child is None or child.completion.index != 0:
            return  # all children see the same prompt: keep one copy
        child.parent.prompt_logprobs.extend(self._logprob_dicts(logprobs))
        self._mark_updated(child)

    def add_token(
        self, request: Request, token_id: int, logprobs: TokenLogprobs | None, now: float
    ) -> str | None:
        """Record a sampled token; returns the stop string if the text now contains one."""
        child = self.children[request.request_id]
        completion = child.completion
        metrics = child.parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_scheduled_time = request.first_scheduled_time
            metrics.num_cached_tokens = max(request.num_cached_tokens, 0)
        metrics.last_token_time = now
        completion.token_ids.append(token_id)
        completion.delta_token_ids.append(token_id)
        if logprobs is not None and completion.logprobs is not None:
            dicts = self._logprob_dicts(logprobs)
            completion.logprobs.extend(dicts)
            completion.delta_logprobs = (completion.delta_logprobs or []) + dicts
            completion.cumulative_logprob += logprobs.logprobs[0][0]
        self._mark_updated(child)
        if child.detokenizer.stop_string is not None:
            return None
        return child.detokenizer.update([token_id])

    def finish(self, request: Request, finish_reason: str, stop_reason) -> None:
        child = self.children.get(request.request_id)
        if child is None:
            return
        child.completion.finish_reason = finish_reason
        child.completion.stop_reason = stop_reason
        self._mark_updated(child)

    def _mark_updated(self, child: ChildState) -> None:
        self.updated[child.parent.request_id] = child.parent

    def make_outputs(self) -> list[RequestOutput]:
        """One RequestOutput per parent with news since the last call; forgets finished ones."""
        now = time.time()
        touched, self.updated = self.updated, {}
        outputs = []
        for parent in touched.values():
            completions = []
            for child in parent.children:
                completion = child.completion
                completion.delta_text = child.detokenizer.take_delta(completion.finished)
                completion.text = child.detokenizer.output_text[: child.detokenizer.num_emitted_chars]
                completions.append(_snapshot(completion))
                completion.delta_token_ids = []
                completion.delta_logprobs = None
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._forget(parent)
            outputs.append(
                RequestOutput(
                    request_id=parent.request_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    prompt_logprobs=parent.prompt_logprobs,
                    metrics=parent.metrics,
                    num_cached_tokens=parent.metrics.num_cached_tokens,
                )
            )
        return outputs

    def abort(self, request_id: str) -> None:
        parent = self.parents.get(request_id)
        if parent is not None:
            self._forget(parent)

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        self.updated.pop(parent.request_id, None)
        for child_id in parent.child_ids:
            self.children.pop(child_id, None)


def _snapshot(completion: CompletionOutput) -> CompletionOutput:
    """A copy the caller may keep while the engine goes on updating the original."""
    return CompletionOutput(
        index=completion.index,
        text=completion.text,
        token_ids=list(completion.token_ids),
        cumulative_logprob=completion.cumulative_logprob,
        logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        delta_text=completion.delta_text,
        delta_token_ids=list(completion.delta_token_ids),
        delta_logprobs=completion.delta_logprobs,
    )
