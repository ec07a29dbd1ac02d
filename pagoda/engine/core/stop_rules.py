"""The token-level stop rules: EOS, stop token ids, max_tokens and the context length.

Called by the request lifecycle (lifecycle.py) for each new token, before it checks stop
strings on the detokenized text; nothing else decides that a request stops.
"""

from __future__ import annotations

from pagoda.engine.core.request import Request, RequestStatus


def check_stop(
    request: Request, token_id: int, max_model_len: int, num_output_tokens: int | None = None,
) -> tuple[RequestStatus, int | None] | None:
    """(finished status, stop_reason) if `token_id`, the request's num_output_tokens-th
    output token (default: its last, just appended), ends it; stop_reason is the stop token
    id that matched (None for EOS and lengths). A step that verified proposals appends
    several tokens at once: each is checked at its own position."""
    params = request.sampling_params
    if num_output_tokens is None:
        num_output_tokens = request.num_output_tokens
    if request.num_prompt_tokens + num_output_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    if num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED, None
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token_id
    # max_tokens None (no cap given) leaves the max_model_len check above as the limit.
    if request.max_tokens is not None and num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None
