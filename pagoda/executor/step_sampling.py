"""The sampling end of a step without proposals to verify (spec_decode/verify.py has the
other): the last position of each request that reaches its end goes through the sampler,
and prompt logprobs are taken chunk by chunk. Also what both ends share: the sampler's
per-row metadata, and the seeded requests' generators."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.executor.input_batch import CachedRequestState
from pagoda.executor.request_faults import contain_non_finite, fail_unsampleable
from pagoda.executor.sampler import NO_TOKEN, compute_token_logprobs, unpack_bitmask
from pagoda.executor.sampling_metadata import SamplingMetadata
from pagoda.outputs import TokenLogprobs
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput


class SeededGenerators:
    """One torch.Generator per seeded request, made from its seed on first use and kept
    until the request is forgotten (so a seeded request's draws do not depend on the rest
    of the batch, nor on preemption). `salt` is added to the seed: a second user of the same
    requests (a draft model) draws numbers independent of the first's."""

    def __init__(self, device: torch.device, salt: int = 0) -> None:
        self.device = device
        self.salt = salt
        self._generators: dict[str, torch.Generator] = {}

    def get(self, state: CachedRequestState) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(state.request_id)
        if generator is None:
            generator = self._generators[state.request_id] = torch.Generator(device=self.device)
            generator.manual_seed(seed + self.salt)
        return generator

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._generators)


def sampling_metadata(
    runner, row_states: list[CachedRequestState], row_output_token_ids: list[list[int]],
    vocab_size: int, scheduler_output: SchedulerOutput, first_row_of: dict[str, int],
) -> SamplingMetadata:
    """The sampler's metadata, one row per entry of row_states (a request verifying
    proposals has several rows, each with the output it would follow). Grammar bitmask rows
    go to their request's rows in order, from first_row_of[request id]."""
    metadata = SamplingMetadata.build(
        params=[s.sampling_params for s in row_states],
        prompt_token_ids=[s.prompt_token_ids for s in row_states],
        output_token_ids=row_output_token_ids,
        generators=[runner.generators.get(s) for s in row_states],
        eos_token_ids=runner.eos_token_ids,
        vocab_size=vocab_size,
        device=runner.device,
    )
    if scheduler_output.grammar_bitmask is not None:
        num_seen: dict[str, int] = {}
        rows = []
        for request_id in scheduler_output.grammar_request_ids:
            offset = num_seen[request_id] = num_seen.get(request_id, -1) + 1
            rows.append(first_row_of[request_id] + offset)
        metadata.grammar_row_ids = torch.tensor(rows, dtype=torch.int64, device=runner.device)
        bitmask = torch.from_numpy(scheduler_output.grammar_bitmask).to(runner.device)
        metadata.grammar_allowed = unpack_bitmask(bitmask, vocab_size)
    return metadata


def sample_last_positions(
    runner, states: list[CachedRequestState], sample_rows: np.ndarray, query_end: np.ndarray,
    hidden: torch.Tensor, scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
) -> None:
    """One token for each request whose step reaches its end (sample_rows: their indices in
    `states`): the last position's logits through the sampler; appended to the runner's
    batch record and to `output`."""
    batch = runner.input_batch
    sample_states = [states[i] for i in sample_rows]
    logits_index = torch.from_numpy(query_end[sample_rows] - 1).to(runner.device)
    logits = runner.model.head_logits(hidden[logits_index])  # (num_sampled, vocab)
    logits = contain_non_finite(logits, sample_states, output)
    metadata = sampling_metadata(
        runner, sample_states, [s.output_token_ids for s in sample_states], logits.shape[-1],
        scheduler_output, first_row_of={s.request_id: i for i, s in enumerate(sample_states)})
    sampled = runner.sampler(logits, metadata)
    sampled_ids = sampled.sampled_token_ids.tolist()  # the step's one host sync
    for row, state, token_id in zip(sample_rows.tolist(), sample_states, sampled_ids):
        if token_id == NO_TOKEN:
            fail_unsampleable(state, output)
        if state.request_id in output.failed:
            continue
        output.sampled_token_ids[row] = token_id
        batch.append_token(state, token_id)
    if sampled.logprobs is not None:
        ids, values = sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist()
        ranks = sampled.sampled_token_ranks.tolist()
        for i, state in enumerate(sample_states):
            num = state.sampling_params.logprobs
            if num is not None:
                output.logprobs[state.request_id] = TokenLogprobs(
                    [ids[i][: 1 + num]], [values[i][: 1 + num]], [ranks[i]]
                )


def prompt_logprobs(
    model, device: torch.device, states: list[CachedRequestState], num_computed: np.ndarray,
    num_scheduled: np.ndarray, query_end: np.ndarray, hidden: torch.Tensor,
    output: ModelRunnerOutput,
) -> None:
    """Logprobs of prompt tokens 1.. under the positions before them, chunk by chunk."""
    for i, state in enumerate(states):
        num_top = state.sampling_params.prompt_logprobs
        start = int(num_computed[i])
        num_prompt_tokens = len(state.prompt_token_ids)
        if num_top is None or start >= num_prompt_tokens:
            continue
        # Positions start .. end-1 of this chunk predict prompt tokens start+1 .. end.
        end = min(start + int(num_scheduled[i]), num_prompt_tokens - 1)
        if end <= start:
            continue
        first_row = int(query_end[i] - num_scheduled[i])
        rows = hidden[first_row : first_row + (end - start)]
        targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=device)
        ids, values, ranks = compute_token_logprobs(model.compute_logits(rows), targets, num_top)
        output.prompt_logprobs[state.request_id] = TokenLogprobs(
            ids.tolist(), values.tolist(), ranks.tolist()
        )
