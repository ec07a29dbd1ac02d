"""Errors a user can cause with a request, typed so that every edge maps them without reading
message text: the server answers a 400 whose `param` and `code` come from the error, the CLI
prints the message (exit 2), the offline API raises it as it is.

Raised by the one validation step of a request (`SamplingParams` on construction, then
`pagoda.engine.core.input_processor.InputProcessor` when the engine knows the model's limits);
the layers below keep assertions only.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses. A ValueError, so callers that catch that still do.

    `param` names the offending request field (SamplingParams / OpenAI names: "prompt",
    "max_tokens", "logit_bias", ...), `code` is an OpenAI-style error code
    ("invalid_value", "context_length_exceeded", ...).

    An error made with `about(param, detail)` reads "<param> <detail>" and keeps the two
    apart, so an endpoint whose field has another name (chat's `top_logprobs` for
    SamplingParams' `logprobs`) renders it again under that name with `renamed`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.detail: str | None = None
        """What is wrong with `param`, when the message is "<param> <detail>"; else None."""

    @classmethod
    def about(cls, param: str, detail: str, code: str = "invalid_value") -> InvalidRequestError:
        """The error "<param> <detail>", e.g. about("top_p", "must be in (0, 1], got 2")."""
        error = cls(f"{param} {detail}", param, code)
        error.detail = detail
        return error

    def renamed(self, param: str) -> InvalidRequestError:
        """The same error about the field as the caller names it: message rendered anew
        when it was made with `about`, otherwise kept (it does not name the field)."""
        if self.detail is not None:
            return type(self).about(param, self.detail, self.code)
        return type(self)(self.message, param, self.code)


class EngineFatalError(RuntimeError):
    """The engine cannot go on: a tensor-parallel worker process died or the ranks fell out
    of step. The step's requests fail with it and the engine loop stops (the server's
    /health turns 503 and it exits non-zero, for a supervisor to restart)."""
