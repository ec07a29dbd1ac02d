"""vLLM's response extras both endpoints share (the request fields are protocol.py's):

    echo (chat)                  the last message, when it is the assistant's, starts the
                                 answer's content: the answer continues it (streamed: one
                                 content chunk per choice right after the role chunks)
    return_tokens_as_token_ids   logprob tokens written "token_id:N", so that tokens that are
                                 not whole UTF-8 text (byte pieces) stay exact
    prompt_logprobs              the prompt tokens' logprobs, as vLLM returns them (chat: on
                                 the response; completions: on each choice):

        [null, {"<token id>": {"logprob": -1.2, "rank": 3, "decoded_token": " the"}, ...}, ...]
         ^ the first prompt token has nothing before it; each later position holds the
           prompt token and the `prompt_logprobs` most likely tokens (rank 1 = the likeliest)
"""

from __future__ import annotations

from typing import Any

from pagoda.entrypoints.openai.serving.pipeline import clamp_logprob
from pagoda.outputs import Logprob, RequestOutput, TokenLogprobDict


def echo_prefix(request: Any) -> str:
    """The text a chat answer starts with: the last message's when `echo` is set and that
    message is the assistant's (the role of the answer), else ""."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return ""
    return last.text()


def token_label(token_id: int, logprob: Logprob | None, as_token_ids: bool,
                decode=None) -> str:
    """A logprob entry's token: "token_id:N" when asked, else its text (`decode([id])` when
    the entry has none)."""
    if as_token_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode([token_id]) if decode is not None else ""


def prompt_logprobs_json(
    output: RequestOutput, num_prompt_tokens: int, num_top: int,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of one prompt: one entry per prompt token (null where there
    is none, as for the first), each the prompt token and its `num_top` likeliest
    alternatives (the engine may have computed more: an echo with more `logprobs`)."""
    positions: list[TokenLogprobDict | None] = list(output.prompt_logprobs or [])
    positions += [None] * (num_prompt_tokens - len(positions))
    result: list[dict[str, dict[str, Any]] | None] = []
    for position in positions[:num_prompt_tokens]:
        if position is None:
            result.append(None)
            continue
        chosen = next(iter(position))  # the prompt token comes first
        result.append({
            str(token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                            "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
            if token_id == chosen or (lp.rank is not None and lp.rank <= num_top)
        })
    return result

