"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers raise `OpenAIError` (or a subclass) or let the validation step's
`InvalidRequestError` through; `install_error_handlers` turns those, pydantic validation
errors, unknown routes and anything unexpected into that body. An InvalidRequestError is a 400
built from its `param` and `code`, its message passed on as it is (never parsed). Only our own
bugs become a 500; anything a client can send maps to a 4xx.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.entrypoints.openai.protocol.responses import ErrorInfo, ErrorResponse
from pagoda.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, "invalid_request_error", param, code)


def invalid_request(error: InvalidRequestError) -> OpenAIError:
    """The 400 of a request the validation step refused."""
    return bad_request(error.message, param=error.param, code=error.code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "invalid_request_error",
        "model", "model_not_found",
    )


def server_overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        message, HTTPStatus.SERVICE_UNAVAILABLE, "server_error", None, "server_overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error(message: str, status: int = HTTPStatus.INTERNAL_SERVER_ERROR) -> OpenAIError:
    return OpenAIError(message, status, "server_error")


def _loc_to_param(loc: tuple) -> str:
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    return param


def from_validation_error(error: ValidationError) -> OpenAIError:
    """One 400 naming the first bad field (and how many more there are)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first['msg']}",
                           code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    loc = tuple(first["loc"])
    # Strict unions report one error per member, tagged with the member's type; keep the field.
    loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))
    param = _loc_to_param(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field (Pagoda rejects unknown fields rather than ignoring them)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    message = f"{param}: {msg}" if param else msg
    others = sorted({_top_field(e) for e in errors[1:]} - {_top_field(first)})
    if others:
        message += f" (and {len(others)} more invalid field(s): {', '.join(sorted(others))})"
    code = "unknown_parameter" if first["type"] == "extra_forbidden" else "invalid_type"
    if first["type"] == "value_error":
        code = "invalid_value"
    return bad_request(message, param=param, code=code)


def _top_field(error: dict) -> str:
    return str(error["loc"][0]) if error["loc"] else ""


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return invalid_request(exc).response()

    @app.exception_handler(ValidationError)
    async def _validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == HTTPStatus.NOT_FOUND:
            message = f"Invalid URL ({request.method} {request.url.path})"
            err = OpenAIError(message, exc.status_code, "invalid_request_error", None,
                              "unknown_url")
        elif exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            message = f"Method {request.method} is not allowed on {request.url.path}"
            err = OpenAIError(message, exc.status_code, "invalid_request_error", None,
                              "method_not_allowed", headers=exc.headers)
        else:
            err = OpenAIError(str(exc.detail), exc.status_code,
                              "invalid_request_error" if exc.status_code < 500 else "server_error")
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return server_error(f"Internal server error: {type(exc).__name__}: {exc}").response()
