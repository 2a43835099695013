"""Errors the HTTP API returns, always in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the client can
fix, 503 when the server cannot take the request now, and 500 only for a bug in plugserve itself.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger("plugserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error response: status, message and OpenAI's ``type`` / ``param`` / ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The problem pydantic found, named by its dotted path as OpenAI's ``param``. For a union
    field (``prompt``: a string or token ids) it lists what each member objected to; the member
    that got deepest into the value is the one the client meant."""
    errors = exc.errors(include_url=False)
    # Deepest first; at equal depth a broken constraint (the value has the right type) says more
    # than "not a string" from a member of another type ("*_type" errors).
    err = max(errors, key=lambda e: (len([p for p in e["loc"] if not _is_union_tag(p)]),
                                     not e["type"].endswith("_type")))
    param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    value = err.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return bad_request(f"Invalid value for '{param}': {err['msg']} (got {shown}).", param, "invalid_value")


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union member it tried into ``loc`` ("str", "list[int]", a model name);
    field names in plugserve's models are lower_snake_case, so these are easy to tell apart."""
    if not isinstance(part, str):
        return False
    return ("[" in part or part in _TYPE_TAGS or part[:1].isupper() or part.startswith("function-")
            or part.startswith("constrained-"))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 / 405 in the same shape as everything else."""
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    return APIError(exc.status_code, str(message), headers=exc.headers).response()


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug in plugserve: logged with its traceback, answered without internals."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, f"internal server error ({type(exc).__name__})", type="server_error").response()


EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: api_error_handler,
    HTTPException: http_exception_handler,
    Exception: unexpected_error_handler,
}
