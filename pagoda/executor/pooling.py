"""Pooling requests' vectors (embeddings), from the step's final hidden states.

The model's forward returns the hidden states after its final norm, before the head,
one row per scheduled token (model_runner.py's batch layout). A pooling request's prompt
may span several steps (chunked prefill); each step hands this module its chunk's rows:

    prompt      [ chunk 0 | chunk 1 | ... | chunk k ]        positions 0 .. P-1
    last        the last row of chunk k
    mean        a running float32 sum over every chunk, divided by P after chunk k
    cls         row 0 of chunk 0, kept until chunk k

so chunking changes nothing but float rounding in the sum. Prefix-cache hits: a request
whose first positions come from the cache never computes their hidden states, so mean and
CLS requests take no cache hits (the scheduler: Request.can_use_prefix_cache); a last-token
request may, because the last prompt token is never served from the cache. A preempted
request returns as new and starts over (its running state is dropped with it).

After the last chunk: cut to `dimensions` (Matryoshka), then L2-normalise when asked,
in float32 whatever the run dtype; the vectors go back as plain lists of floats.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.executor.input_batch import CachedRequestState
from pagoda.step_data import ModelRunnerOutput


def pool_chunks(
    states: list[CachedRequestState], num_computed: np.ndarray, num_scheduled: np.ndarray,
    query_start: np.ndarray, hidden: torch.Tensor, output: ModelRunnerOutput,
) -> None:
    """Advance every pooling request of the step (aligned arrays over `states`, the step's
    batch order; `hidden` (num_tokens, hidden_size)); those whose prompt ends this step get
    their vector in `output.pooled`."""
    finished: list[tuple[CachedRequestState, torch.Tensor]] = []
    for i, state in enumerate(states):
        params = state.pooling_params
        if params is None:
            continue
        start, count = int(num_computed[i]), int(num_scheduled[i])
        first_row = int(query_start[i])
        rows = hidden[first_row : first_row + count]  # (count, hidden_size)
        num_prompt_tokens = len(state.prompt_token_ids)
        if params.pooling == "mean":
            assert start == 0 or state.pooled is not None, "mean pooling saw every chunk"
            chunk_sum = rows.float().sum(dim=0)
            state.pooled = chunk_sum if state.pooled is None else state.pooled + chunk_sum
        elif params.pooling == "cls" and start == 0:
            state.pooled = rows[0].float().clone()
        if start + count < num_prompt_tokens:
            continue  # a partial prefill chunk
        if params.pooling == "last":
            vector = rows[-1].float()
        elif params.pooling == "mean":
            vector = state.pooled / num_prompt_tokens
        else:
            assert state.pooled is not None, "CLS pooling saw the first chunk"
            vector = state.pooled
        state.pooled = None
        finished.append((state, vector))
    for state, vector in finished:
        output.pooled[state.request_id] = finish_vector(vector, state).tolist()


def finish_vector(vector: torch.Tensor, state: CachedRequestState) -> torch.Tensor:
    """(hidden_size,) float32 -> (dimensions or hidden_size,): cut, then normalised."""
    params = state.pooling_params
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector
