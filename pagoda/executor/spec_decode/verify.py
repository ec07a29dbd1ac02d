"""The runner's verification step: the logits of every position a request verifies, the
rejection sampler, then the batch record and the step's output brought up to date (accepted
proposals and the sampled token appended, the rejected proposals' KV rolled back).

    request with proposals d1..dk, its scheduled tokens end at query_end:
    hidden rows   query_end-1-k ... query_end-1     (k + 1 rows, logits for each)
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.executor.request_faults import contain_non_finite, fail_unsampleable
from pagoda.executor.sampler import NO_TOKEN
from pagoda.executor.spec_decode.rejection_sampler import rejection_sample
from pagoda.executor.step_sampling import sampling_metadata
from pagoda.outputs import TokenLogprobs
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput


def one_row_per_token(
    num_computed: np.ndarray, num_scheduled: np.ndarray, block_tables: list[np.ndarray],
    split: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Attention rows for a step that verifies proposals: each token of a sequence marked in
    `split` (a decode or a verification) becomes a row of its own, one query token over its
    causal prefix in the sequence's blocks; the others (prefill chunks) stay one row each.
    Token order is unchanged, so the forward's output is too. A verifying step then has the
    shape of a decode step, which the CPU kernels run whole (the attention kernel writes the
    step's keys before any row attends).

        sequence   computed 9, scheduled 3      ->  rows (9, 1) (10, 1) (11, 1)
                   its block table row          ->  the same row three times

    Returns (num_computed, num_scheduled, block_tables) per row."""
    rows_per_seq = np.where(split, num_scheduled, 1)
    seq_of_row = np.repeat(np.arange(len(num_scheduled)), rows_per_seq)
    first_row = np.cumsum(rows_per_seq) - rows_per_seq
    offset = np.arange(int(rows_per_seq.sum())) - first_row[seq_of_row]
    split_row = split[seq_of_row]
    row_computed = num_computed[seq_of_row] + np.where(split_row, offset, 0)
    row_scheduled = np.where(split_row, 1, num_scheduled[seq_of_row])
    return row_computed, row_scheduled, [table[seq_of_row] for table in block_tables]


def verify_proposals(
    runner, states, sample_rows: np.ndarray, query_end: np.ndarray, hidden: torch.Tensor,
    scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
) -> None:
    """The sampling part of a step in which some requests verify proposals (runner: the
    ModelRunner; states in batch order; sample_rows: the indices of those whose step
    reaches its end)."""
    batch = runner.input_batch
    spec = scheduler_output.spec_token_ids
    sample_states = [states[i] for i in sample_rows]
    proposals = [list(spec.get(s.request_id, ())) for s in sample_states]
    counts = np.array([1 + len(p) for p in proposals], dtype=np.int64)
    first_rows = np.cumsum(counts) - counts  # first logits row of each request
    # rows query_end - counts .. query_end - 1 of each request, in order
    hidden_index = (np.repeat(query_end[sample_rows] - counts - first_rows, counts)
                    + np.arange(int(counts.sum())))
    logits = runner.model.head_logits(hidden[torch.from_numpy(hidden_index).to(runner.device)])
    row_states = [s for s, count in zip(sample_states, counts) for _ in range(count)]
    logits = contain_non_finite(logits, row_states, output)
    row_outputs = [s.output_token_ids + p[:j] for s, p in zip(sample_states, proposals)
                   for j in range(1 + len(p))]
    metadata = sampling_metadata(
        runner, row_states, row_outputs, logits.shape[-1], scheduler_output,
        first_row_of={s.request_id: int(r) for s, r in zip(sample_states, first_rows)})
    draft_probs = [runner.spec_decoder.draft_probs(s.request_id, len(p)) if p else None
                   for s, p in zip(sample_states, proposals)]
    verified = rejection_sample(runner.sampler, logits, metadata, proposals, draft_probs)

    decoder = runner.spec_decoder
    for index, (batch_row, state) in enumerate(zip(sample_rows.tolist(), sample_states)):
        token_ids, num_accepted = verified.token_ids[index], verified.num_accepted[index]
        if token_ids[-1] == NO_TOKEN:
            fail_unsampleable(state, output)
        if state.request_id in output.failed:
            continue
        num_proposed = len(proposals[index])
        if num_proposed:
            output.num_accepted_tokens[state.request_id] = num_accepted
            decoder.record(state.request_id, num_proposed, num_accepted)
            if num_accepted < num_proposed:
                batch.roll_back(state, num_proposed - num_accepted, runner.block_size)
        output.sampled_token_ids[batch_row] = token_ids[-1]
        for token_id in token_ids:
            batch.append_token(state, token_id)
        num_top = state.sampling_params.logprobs
        if num_top is not None and verified.logprobs is not None:
            rows = slice(int(first_rows[index]), int(first_rows[index]) + len(token_ids))
            output.logprobs[state.request_id] = TokenLogprobs(
                [ids[: 1 + num_top] for ids in verified.logprob_token_ids[rows].tolist()],
                [values[: 1 + num_top] for values in verified.logprobs[rows].tolist()],
                verified.ranks[rows].tolist())
