"""The one owner of a request's life, from a validated EngineRequest to its last output.

    add_request   EngineRequest -> its sequences (Requests) for the scheduler; for n > 1,
                  n children with ids `"{index}_{parent id}"` (seeded `seed + index`) that
                  share their prompt blocks through the prefix cache
    process_step  each new token: logprobs recorded, every stop rule applied in one place
                  (EOS, stop ids, max_tokens, context length: stop_rules.py; stop strings:
                  the detokenizer) -> the sequences that finished, with their status; a
                  pooling request ends ("stop") in the step its vector comes back
    take_failed   the sequences whose own grammar or detokenization raised (each fails
                  alone: the engine aborts its request and reports it as an error)
    abort         -> the sequences to finish
    make_outputs  one RequestOutput per parent with news, children folded back in index
                  order; a parent whose children all finished is forgotten

Only this module maps parents to children; the scheduler frees the ids it is told, and
nothing outside the engine sees a child id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from pagoda.engine.core.detokenizer import IncrementalDetokenizer
from pagoda.engine.core.grammar import GrammarCompiler, GrammarMatcher, allocate_bitmask
from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.stop_rules import check_stop
from pagoda.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobDict,
    TokenLogprobs,
)
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobDict | None] | None = None
    embedding: list[float] | None = None
    """A pooling request's vector, once its prompt is computed."""

    @property
    def finished(self) -> bool:
        return all(c.completion.finished for c in self.children)


@dataclass
class ChildState:
    parent: ParentState
    request: Request
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    matcher: GrammarMatcher | None = None
    """The sequence's place in its structured-output grammar (None: unconstrained)."""


class RequestLifecycle:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int], max_model_len: int,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.grammar_compiler = grammar_compiler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}
        self.updated: dict[str, ParentState] = {}
        """Parents with news since the last make_outputs (so a step touches only those)."""
        self.num_grammar_sequences = 0
        """Sequences held that follow a grammar (0: a step needs no bitmask)."""
        self.num_output_tokens = 0
        """Tokens recorded as output since start (a step's tokens after a stop are not)."""
        self.failed: dict[str, str] = {}
        """Sequences stopped by a fault of their own (id -> reason): an exception in their
        grammar or their detokenization. Their tokens are not processed; the engine takes
        them (take_failed) and aborts their requests, the rest of the batch goes on."""

    # ---- start and end -----------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> list[Request]:
        """Register a request; returns its sequences, for the scheduler to queue."""
        assert request.request_id not in self.parents, request.request_id
        params = request.params
        assert request.pooling is None or params.n == 1, "a pooling request has one sequence"
        parent = ParentState(
            request.request_id, request.prompt, request.prompt_token_ids, params,
            RequestMetrics(request.arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.n == 1:
            child_ids = [request.request_id]
        else:
            child_ids = [f"{i}_{request.request_id}" for i in range(params.n)]
        sequences = []
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Each choice gets its own seed, or all n would be the same text.
                child_params = params.clone()
                child_params.seed = params.seed + index
            sequence = Request(
                child_id, request.prompt_token_ids, child_params, self.eos_token_ids,
                arrival_time=request.arrival_time, priority=request.priority,
                max_tokens=request.max_tokens, pooling_params=request.pooling,
                lora_request=request.lora_request,
            )
            sequences.append(sequence)
            completion = CompletionOutput(
                index=index,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
            matcher = None
            if request.grammar is not None:
                matcher = self.grammar_compiler.matcher(request.grammar)
                self.num_grammar_sequences += 1
            child = ChildState(parent, sequence, completion, detokenizer, matcher)
            parent.children.append(child)
            self.children[child_id] = child
        self.parents[request.request_id] = parent
        return sequences

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def abort(self, request_id: str) -> list[str]:
        """Forget a request (no further output); returns its unfinished sequences' ids, for
        the scheduler to free. Unknown ids return []."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return [c.request.request_id for c in parent.children if not c.completion.finished]

    def parent_id(self, sequence_id: str) -> str | None:
        child = self.children.get(sequence_id)
        return None if child is None else child.parent.request_id

    def take_failed(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def _fail(self, sequence_id: str, what: str, error: Exception) -> None:
        logger.exception("sequence %s: %s failed", sequence_id, what)
        self.failed.setdefault(sequence_id, f"{what} failed: {type(error).__name__}: {error}")

    # ---- one step ----------------------------------------------------------------------------

    def process_step(
        self, new_tokens: list[tuple[Request, int]], runner_output: ModelRunnerOutput,
        now: float,
    ) -> list[tuple[str, RequestStatus]]:
        """Record the step's tokens and logprobs and apply every stop rule; returns the
        sequences that finished (id, status) for the scheduler to free."""
        for sequence_id, logprobs in runner_output.prompt_logprobs.items():
            self._add_prompt_logprobs(sequence_id, logprobs)
        finished = [(sequence_id, RequestStatus.FINISHED_STOPPED)
                    for sequence_id, vector in runner_output.pooled.items()
                    if self._add_embedding(sequence_id, vector, now)]
        stopped: set[str] = set()
        num_seen: dict[str, int] = {}  # tokens of each sequence met so far this step
        for sequence, token_id in new_tokens:
            sequence_id = sequence.request_id
            index = num_seen[sequence_id] = num_seen.get(sequence_id, -1) + 1
            child = self.children.get(sequence_id)
            if child is None or sequence_id in self.failed or sequence_id in stopped:
                continue  # aborted meanwhile, failing, or stopped by an earlier token
            try:
                stop_string = self._add_token(
                    child, token_id, _position(runner_output.logprobs.get(sequence_id), index),
                    now,
                )
                stop = check_stop(sequence, token_id, self.max_model_len,
                                  len(child.completion.token_ids))
                # A token that completes the grammar ends the output as EOS does: even as
                # the last token max_tokens allows, the output is complete ("stop").
                at_length = stop is not None and stop[0] is RequestStatus.FINISHED_LENGTH
                if child.matcher is not None and (stop is None or at_length):
                    stop = _grammar_stop(child.matcher, token_id) or stop
            except Exception as e:  # noqa: BLE001 -- its own fault: it fails alone
                self._fail(sequence.request_id, "processing its new token", e)
                continue
            if stop_string is not None:  # a stop string wins: its text is cut there
                stop = (RequestStatus.FINISHED_STOPPED, stop_string)
            if stop is not None:
                status, stop_reason = stop
                child.completion.finish_reason = status.finish_reason
                child.completion.stop_reason = stop_reason
                finished.append((sequence.request_id, status))
                stopped.add(sequence.request_id)
        return finished

    def fill_grammar_bitmask(
        self, sequence_ids: list[str], vocab_size: int,
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> tuple[list[str], np.ndarray | None]:
        """The bitmask rows of those of `sequence_ids` that follow a grammar (sequences about
        to sample), in order: (their ids, (len(ids), words) int32), or ([], None). A
        sequence verifying k proposals (`spec_token_ids`, grammar-valid: see
        grammar_valid_proposals) gets k + 1 rows, its id repeated: the allowed tokens after
        each prefix of its proposals."""
        spec_token_ids = spec_token_ids or {}
        constrained = [(i, self.children[i].matcher) for i in sequence_ids
                       if i in self.children and self.children[i].matcher is not None]
        if not constrained:
            return [], None
        row_ids = [i for i, _ in constrained for _ in range(1 + len(spec_token_ids.get(i, ())))]
        bitmask = allocate_bitmask(len(row_ids), vocab_size)
        row = 0
        for sequence_id, matcher in constrained:
            proposals = spec_token_ids.get(sequence_id, [])
            try:
                matcher.fill_bitmask_rows(bitmask, row, proposals)
            except Exception as e:  # noqa: BLE001 -- its own fault: it fails alone
                self._fail(sequence_id, "computing its grammar's allowed tokens", e)
                # every token allowed: the sampler needs one; the rows are dropped
                bitmask[row : row + 1 + len(proposals)] = -1
            row += 1 + len(proposals)
        return row_ids, bitmask

    def grammar_valid_proposals(self, sequence_id: str, proposals: list[int]) -> list[int]:
        """The longest prefix of a sequence's proposals its grammar allows (all of them
        without a grammar); a proposal the grammar refuses would only be rejected."""
        child = self.children.get(sequence_id)
        if child is None or child.matcher is None or not proposals:
            return proposals
        try:
            return proposals[: child.matcher.num_valid(proposals)]
        except Exception as e:  # noqa: BLE001 -- its own fault: it fails alone
            self._fail(sequence_id, "checking proposals against its grammar", e)
            return []

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

    def _add_embedding(self, sequence_id: str, vector: list[float], now: float) -> bool:
        """Record a pooling request's vector and end it; False for one gone meanwhile
        (aborted) or failing."""
        child = self.children.get(sequence_id)
        if child is None or sequence_id in self.failed:
            return False
        metrics = child.parent.metrics
        metrics.first_scheduled_time = child.request.first_scheduled_time
        metrics.num_cached_tokens = max(child.request.num_cached_tokens, 0)
        metrics.last_token_time = now
        child.parent.embedding = vector
        child.completion.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
        self._mark_updated(child)
        return True

    def _add_prompt_logprobs(self, sequence_id: str, logprobs: TokenLogprobs) -> None:
        child = self.children.get(sequence_id)
        if child is None or child.completion.index != 0:
            return  # all children see the same prompt: keep one copy
        child.parent.prompt_logprobs.extend(self._logprob_dicts(logprobs))
        self._mark_updated(child)

    def _add_token(
        self, child: ChildState, token_id: int, logprobs: TokenLogprobs | None, now: float
    ) -> str | None:
        """Record a sampled token; returns the stop string if the text now contains one."""
        request = child.request
        completion = child.completion
        metrics = child.parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_scheduled_time = request.first_scheduled_time
            metrics.num_cached_tokens = max(request.num_cached_tokens, 0)
        metrics.last_token_time = now
        completion.token_ids.append(token_id)
        completion.delta_token_ids.append(token_id)
        self.num_output_tokens += 1
        if logprobs is not None and completion.logprobs is not None:
            dicts = self._logprob_dicts(logprobs)
            completion.logprobs.extend(dicts)
            completion.delta_logprobs = (completion.delta_logprobs or []) + dicts
            completion.cumulative_logprob += logprobs.logprobs[0][0]
        self._mark_updated(child)
        if child.detokenizer.stop_string is not None:
            return None
        return child.detokenizer.update([token_id])

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
                    embedding=parent.embedding,
                )
            )
        return outputs

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        self.updated.pop(parent.request_id, None)
        for child in parent.children:
            removed = self.children.pop(child.request.request_id, None) is not None
            if removed and child.matcher is not None:
                self.num_grammar_sequences -= 1


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


def _position(logprobs: TokenLogprobs | None, index: int) -> TokenLogprobs | None:
    """The logprobs of a step's index-th token of a sequence (a step that verified
    proposals emits several)."""
    if logprobs is None or (index == 0 and len(logprobs.ranks) == 1):
        return logprobs
    return TokenLogprobs([logprobs.token_ids[index]], [logprobs.logprobs[index]],
                         [logprobs.ranks[index]])


def _grammar_stop(matcher: GrammarMatcher, token_id: int) -> tuple[RequestStatus, None] | None:
    """Advance the grammar; a complete grammar (or, should the mask ever have let one
    through, a refused token) ends the sequence."""
    if not matcher.accept(token_id):
        logger.warning("a sampled token was refused by its grammar: %s", matcher.error)
        return RequestStatus.FINISHED_ABORTED, None
    if matcher.is_finished:
        return RequestStatus.FINISHED_STOPPED, None
    return None
