"""Usage on every stream: the gateway asks the engine for it and hides it from clients that did not.

A streamed chat or completion carries token counts only when the client sends
``stream_options.include_usage``; without them the token metrics, the output-length learning and the
access log would miss every such stream. So the gateway asks the engine for usage itself and drops
the usage-only chunk (``"choices": []`` with ``usage``; OpenAI's format for it) from that client's
stream: the client sees the stream it asked for, the gateway reads the counts from the bytes it
relayed. A client that asked for usage gets the engine's stream untouched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import orjson

# An empty ``choices`` array as a JSON member. Inside a JSON string the quotes would be escaped
# (\"choices\"), so this cannot match a model's text; it only preselects events to parse.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def asked_for_usage(body: Mapping[str, object]) -> bool:
    """Did the client ask for the usage chunk itself? (validate_body lets only an object or null through.)"""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def upstream_body(raw: bytes, body: Mapping[str, object], add_usage: bool, priority: int | None) -> bytes:
    """The body to send the engine: the client's ``raw`` bytes, with ``stream_options.include_usage``
    set when ``add_usage`` and ``priority`` set when not None.

    ``body`` is ``raw`` already parsed (the request path parses once). When the members to set are
    absent, they are spliced in before the closing brace (no serialization; no duplicate keys, whose
    meaning differs between JSON parsers); otherwise the object is serialized again with them."""
    if not add_usage and priority is None:
        return raw
    if "stream_options" not in body and "priority" not in body:
        end = raw.rindex(b"}")  # raw is a JSON object with members (validate_body requires "model")
        usage = b"," + _USAGE_OPTION if add_usage else b""
        rank = b',"priority":%d' % priority if priority is not None else b""
        return b"".join((raw[:end], usage, rank, b"}"))
    rewritten = dict(body)
    if add_usage:
        options = body.get("stream_options")
        # other options (vLLM's continuous_usage_stats, say) are kept as the client sent them
        rewritten["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    if priority is not None:
        rewritten["priority"] = priority
    return orjson.dumps(rewritten)


def _blank_line_before(data: bytes, at: int) -> int:
    """Where the SSE event holding byte ``at`` begins: just past the last blank line before it, or 0."""
    lf = data.rfind(b"\n\n", 0, at)
    crlf = data.rfind(b"\n\r\n", 0, at)
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _blank_line_after(data: bytes, at: int) -> int:
    """Just past the first blank line at or after ``at`` (the end of that event), or -1 if none yet."""
    lf = data.find(b"\n\n", at)
    crlf = data.find(b"\n\r\n", at)
    ends = [end for end in (lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1) if end >= 0]
    return min(ends) if ends else -1


def _is_usage_only(event: bytes) -> bool:
    payload = event.strip()
    if not payload.startswith(b"data:"):
        return False
    try:
        chunk = orjson.loads(payload[5:])
    except orjson.JSONDecodeError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


def _drop_usage_events(events: bytes) -> bytes:
    """``events`` (whole SSE events) without the usage-only ones; the same object when there is none."""
    found = _EMPTY_CHOICES.search(events)
    if found is None:
        return events
    kept: list[bytes] = []
    pos = 0
    while found is not None:
        start = _blank_line_before(events, found.start())
        end = _blank_line_after(events, found.end())  # >= 0: ``events`` ends with a blank line
        if _is_usage_only(events[start:end]):
            kept.append(events[pos:start])
            pos = end
        found = _EMPTY_CHOICES.search(events, end)
    kept.append(events[pos:])
    return b"".join(kept)


class UsageChunkFilter:
    """Passes an SSE byte stream through, less its usage-only chunk.

    An event may arrive split over several reads: the bytes after the last blank line wait for the
    rest of their event (an SSE client dispatches an event only at its blank line, so holding them
    back delays nothing it could show). An engine that puts usage on every chunk (vLLM's
    ``continuous_usage_stats``) loses only the final usage-only chunk; its content chunks pass."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, piece: bytes) -> bytes:
        """The bytes of whole events so far that the client should get (may be empty)."""
        if not self._pending and piece.endswith(b"\n\n"):  # whole events, as engines write them: the usual case
            return _drop_usage_events(piece)
        data = self._pending + piece if self._pending else piece
        end = _blank_line_before(data, len(data))
        self._pending = data[end:]
        return _drop_usage_events(data[:end]) if end else b""

    def flush(self) -> bytes:
        """What is left when the stream ends: an unfinished event, passed on as it came."""
        rest, self._pending = self._pending, b""
        return rest
