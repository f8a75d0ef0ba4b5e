"""OpenAI's error envelope, ready-made for each status the gateway answers with."""

from __future__ import annotations

import orjson
from aiohttp import web

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """Raised anywhere below a handler to answer the client with an OpenAI-style error."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, retry_after_s: float | None = None,
                 allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.allow = allow  # a 405's methods: the Allow header RFC 9110 requires of it


def unreadable_body(exc: Exception) -> ApiError:
    """A body aiohttp could not read (its Content-Encoding does not decode it, or a chunk is broken): the
    client's fault, a 400, not the 500 an unexpected exception would be."""
    return ApiError(400, f"The request body could not be read: {exc}.", "invalid_body")


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    kind = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_response(err: ApiError, extra_headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(extra_headers) if extra_headers else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after_s + 0.999)))
    if err.allow is not None:
        headers["Allow"] = err.allow
    if err.status == 401:  # RFC 9110 11.6.1: a 401 names the scheme that would do
        headers["WWW-Authenticate"] = 'Bearer realm="polymorph"'
    return web.Response(
        status=err.status,
        body=error_body(err.status, err.message, err.code, err.param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, code: str) -> bytes:
    """The last event of a stream that broke after its first byte: clients see an error, not a truncation."""
    return b"data: " + error_body(502, message, code) + b"\n\ndata: [DONE]\n\n"
