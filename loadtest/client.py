"""One OpenAI chat-completions request over a shared aiohttp session, timed token by token.

The runner owns the schedule; this module owns the wire: the request body (``max_tokens`` = the
target output, ``ignore_eos`` so the output has that length, the trace's ``hash_ids`` as an
extension field), the tier header, and parsing the SSE stream into TTFT, inter-token gaps and TPOT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from loadtest.record import RequestRecord
from loadtest.spec import RequestSpec

ROUTING_HEADERS = ("x-polymorph-pool", "x-polymorph-replica", "x-polymorph-shape")
TIER_HEADER = "x-polymorph-tier"
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """Everything needed to send one spec; built ahead of its send time."""

    index: int
    spec: RequestSpec
    body: bytes
    headers: dict[str, str]
    stream: bool


def prepare(
    index: int, spec: RequestSpec, text: str, model: str, stream: bool, api_key: str | None
) -> PreparedRequest:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": spec.output_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if spec.hash_ids:
        body["hash_ids"] = list(spec.hash_ids)
    headers = {"Content-Type": "application/json", TIER_HEADER: spec.tier}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return PreparedRequest(index, spec, orjson.dumps(body), headers, stream)


@dataclass(slots=True)
class _Timing:
    """Mutable scratch while one response streams in (never leaves this module)."""

    token_at_s: list[float]
    input_tokens: int | None = None
    output_tokens: int | None = None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    request: PreparedRequest,
    scheduled_at_s: float,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send ``request`` now and measure it; never raises for HTTP or connection failures."""
    stream = request.stream
    sent_at_s = clock()
    timing = _Timing([])
    status, error, routing = 0, "", ("", "", "")
    try:
        async with session.post(url, data=request.body, headers=request.headers) as response:
            status = response.status
            routing = tuple(response.headers.get(name, "") for name in ROUTING_HEADERS)  # type: ignore[assignment]
            if status != 200:
                error = f"http {status}: {(await response.text())[:_MAX_ERROR_CHARS]}"
            elif stream:
                error = await _read_stream(response, timing, clock)
            else:
                error = _read_body(await response.read(), timing)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    done_at_s = clock()
    return _record(request, scheduled_at_s, sent_at_s, done_at_s, status, error, routing, timing, stream)


async def _read_stream(response: aiohttp.ClientResponse, timing: _Timing, clock: Callable[[], float]) -> str:
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return ""
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return f"bad SSE event: {payload[:100]!r}"
        if "error" in event:
            return f"stream error: {str(event['error'])[:_MAX_ERROR_CHARS]}"
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                timing.token_at_s.append(clock())
        _take_usage(event, timing)
    return "" if timing.token_at_s else "stream ended without tokens or [DONE]"


def _read_body(raw: bytes, timing: _Timing) -> str:
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return f"response is not JSON: {raw[:100]!r}"
    _take_usage(answer, timing)
    return ""


def _take_usage(event: dict[str, object], timing: _Timing) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict):
        timing.input_tokens = usage.get("prompt_tokens", timing.input_tokens)
        timing.output_tokens = usage.get("completion_tokens", timing.output_tokens)


def _record(
    request: PreparedRequest,
    scheduled_at_s: float,
    sent_at_s: float,
    done_at_s: float,
    status: int,
    error: str,
    routing: tuple[str, str, str],
    timing: _Timing,
    stream: bool,
) -> RequestRecord:
    spec = request.spec
    tokens = timing.token_at_s
    num_output = timing.output_tokens if timing.output_tokens is not None else len(tokens)
    ttft_s = tokens[0] - sent_at_s if tokens else None
    itl_s = tuple(later - earlier for earlier, later in zip(tokens, tokens[1:]))
    tpot_s = (tokens[-1] - tokens[0]) / (num_output - 1) if len(tokens) > 1 and num_output > 1 else None
    return RequestRecord(
        index=request.index,
        scheduled_at_s=scheduled_at_s,
        sent_at_s=sent_at_s,
        ttft_s=ttft_s,
        itl_s=itl_s,
        tpot_s=tpot_s,
        e2e_s=done_at_s - sent_at_s if status == 200 and not error else None,
        input_tokens=timing.input_tokens if timing.input_tokens is not None else spec.input_tokens,
        output_tokens=num_output,
        target_input_tokens=spec.input_tokens,
        target_output_tokens=spec.output_tokens,
        status=status,
        error=error,
        tenant=spec.tenant,
        tier=spec.tier,
        domain=spec.domain,
        label=spec.label,
        stream=stream,
        pool=routing[0],
        replica=routing[1],
        shape=routing[2],
    )
