"""Malformed HTTP from a client is the client's problem: an answer in OpenAI's error envelope, as every
other error of ``polymorph serve`` and ``polymorph controller``, and one line in their logs, not a
traceback per attempt."""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from gateway.errors import error_body

# aiohttp quotes up to 100 bytes of an oversized line and points at the bad byte on two more lines; the
# envelope keeps the first line, at most this long.
_REASON_MAX_CHARS = 200
# The request codings aiohttp decodes without optional packages (RFC 9110 15.5.16: a 415 names them).
_DECODED = "gzip, deflate"


class _OneLineParseErrors(logging.Filter):
    """A request aiohttp's parser refuses is logged by aiohttp with its traceback; and a body its
    Content-Encoding does not decode was answered 400 already (``invalid_body``, or the controller's
    ``invalid_report``), then aiohttp meets the error again as it drains the rest of that body, and would log
    it as an "Unhandled exception" with its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RequestPayloadError):
            record.msg = "a request body its Content-Encoding did not decode (answered 400)"
        elif isinstance(error, HttpProcessingError):
            record.msg = f"rejected malformed HTTP request: {type(error).__name__}"
        else:
            return True
        record.args = ()
        record.exc_info = None
        return True


def _log_parse_errors_in_one_line() -> None:
    """Install the filter on aiohttp's server logger (once, however often called)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineParseErrors) for f in logger.filters):
        logger.addFilter(_OneLineParseErrors())


class _EnvelopeRequestHandler(RequestHandler):
    """A connection whose own error answers (a request the parser refuses never reaches the app, whose
    middleware answers everything else) carry the envelope instead of aiohttp's plain text."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it, and raises if the answer had begun
        headers: dict[str, str] = {}
        if isinstance(exc, ContentEncodingError):  # a coding aiohttp has no decoder for (br, zstd) at this pin
            status, headers["Accept-Encoding"] = 415, _DECODED
            body = error_body(status, f"This Content-Encoding is not supported; send the body uncompressed or as {_DECODED}.",
                              "unsupported_content_encoding")
        elif 400 <= status < 500:
            detail = exc.message if isinstance(exc, HttpProcessingError) and exc.message else HTTPStatus(status).phrase
            reason = detail.strip().splitlines()[0].rstrip(":")[:_REASON_MAX_CHARS]
            body = error_body(status, f"Malformed HTTP request: {reason}.", "malformed_http")
        else:  # the app's middleware answers its own failures; this is aiohttp's last resort
            body = error_body(status, f"{HTTPStatus(status).phrase}; it has been logged.", "internal_error")
        answer = web.Response(status=status, body=body, content_type="application/json", headers=headers)
        answer.force_close()  # the stream's framing is lost: nothing after this request can be read
        return answer


class _EnvelopeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _EnvelopeRequestHandler(self, loop=self._loop, **self._kwargs)


class EnvelopeAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer malformed HTTP in the envelope and log it in one line.

    aiohttp offers no hook for the answers its protocol layer makes itself; its ``Server`` builds one
    ``RequestHandler`` per connection, so the server the runner makes is given a class whose handler
    overrides ``handle_error`` (aiohttp is pinned; tests/gateway/test_gateway_e2e.py and
    test_controller_process.py check both servers' answers)."""

    async def _make_server(self) -> web.Server:
        _log_parse_errors_in_one_line()
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer
        return server
