"""A replica that breaks HTTP or SSE must cost the client a clear error, never a bad answer or a dropped connection.

Regression tests for: an out-of-range or 3-digit-but-invalid status passed through (999, 1000000);
a header with a bare LF crashing the response (aiohttp refused to write it: the client saw a closed
connection); a body cut by a bad Content-Length read as a complete empty 200; a 200 whose body is
not JSON passed through as a success.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from loadtest.chaos.garbage import MODES
from loadtest.chaos.hostile import has_envelope, raw_request, send_raw
from loadtest.chaos.stack import ChaosStack
from tests.chaos.conftest import BETA_KEY


def _ask(stack: ChaosStack, mode: str, stream: bool):  # type: ignore[no-untyped-def]
    body = orjson.dumps({"model": "garbage-model", "messages": [{"role": "user", "content": f"mode:{mode}"}], "stream": stream})
    raw = raw_request("/v1/chat/completions", body, [("Authorization", f"Bearer {BETA_KEY}"), ("Content-Type", "application/json")])
    answer = asyncio.run(send_raw(stack.gateway_port, raw))
    assert answer is not None, f"{mode}: no HTTP answer"
    return answer


@pytest.mark.parametrize("mode", sorted(MODES))
def test_non_streaming_garbage_is_a_502_envelope(hostile_stack: ChaosStack, mode: str) -> None:
    answer = _ask(hostile_stack, mode, stream=False)
    assert "x-injected" not in answer.headers
    if mode == "header-with-newline":  # a bare LF ends the header line: a valid answer, nothing injected
        assert answer.status == 200 and answer.headers["content-type"] == "application/json"
        return
    assert answer.status == 502 and has_envelope(answer.body), (mode, answer.status, answer.body[:200])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_streaming_garbage_ends_with_an_error_event(hostile_stack: ChaosStack, mode: str) -> None:
    answer = _ask(hostile_stack, mode, stream=True)
    if answer.status == 200:  # the stream had started: it must end with an error event, then [DONE]
        assert b'data: {"error"' in answer.body and answer.body.rstrip().endswith(b"data: [DONE]"), (mode, answer.body[-300:])
    else:
        assert answer.status == 502 and has_envelope(answer.body), (mode, answer.status, answer.body[:200])
