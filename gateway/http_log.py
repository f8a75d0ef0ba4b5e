"""Malformed HTTP from a client is the client's problem: one line in the log of ``polymorph serve`` and of
``polymorph controller``, not a traceback per attempt."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError


class _OneLineParseErrors(logging.Filter):
    """A body its Content-Encoding does not decode was answered 400 already (``invalid_body``, or the
    controller's ``invalid_report``); aiohttp meets the error again as it drains the rest of that body, and
    would log it as an "Unhandled exception" with its traceback."""

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


def log_parse_errors_in_one_line() -> None:
    """Install the filter on aiohttp's server logger (once, however often called)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineParseErrors) for f in logger.filters):
        logger.addFilter(_OneLineParseErrors())
