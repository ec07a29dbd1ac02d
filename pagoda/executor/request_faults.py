"""Faults of one request inside a step: found in the batch's tensors, they stop that request
alone (ModelRunnerOutput.failed, request id -> reason; the engine aborts it and reports the
reason) while the other rows of the step go on.

    logits with a NaN or infinity (the model's)      -> contain_non_finite, before sampling
    no finite probability left after sampling params -> the sampler's NO_TOKEN, then
                                                        fail_unsampleable
"""

from __future__ import annotations

import torch

from pagoda.step_data import ModelRunnerOutput

NON_FINITE_LOGITS = ("the model produced non-finite logits (NaN or infinity) for this "
                     "request; it was stopped")
UNSAMPLEABLE = ("its next-token probabilities were not finite after its sampling parameters "
                "were applied (a repetition penalty or temperature out of usable range?); it "
                "was stopped")


def contain_non_finite(logits: torch.Tensor, states, output: ModelRunnerOutput) -> torch.Tensor:
    """Rows (one per state, in order) with a NaN or infinite logit fail their request alone
    and are zeroed so that the sampler sees nothing it cannot handle; the other rows are as
    they were. One reduction and one host sync a step."""
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))  # no float copy
    if bool(finite.all()):
        return logits
    for row in (~finite).nonzero().flatten().tolist():
        output.failed[states[row].request_id] = NON_FINITE_LOGITS
    return logits.masked_fill(~finite[:, None], 0.0)


def fail_unsampleable(state, output: ModelRunnerOutput) -> None:
    """The sampler found no usable probability in this request's row (NO_TOKEN)."""
    output.failed.setdefault(state.request_id, UNSAMPLEABLE)
