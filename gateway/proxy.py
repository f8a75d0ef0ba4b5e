"""The upstream call: pick a replica, send, retry before the first byte, pass the answer through.

Retries happen only while nothing has reached the client: a connect error, a timeout before the
response head, or a 5xx/429 answer moves the request to another replica, within ``max_attempts``
and the retry budget. Once a stream has started, a failure ends it with an SSE error event.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from classifiers.shape import Shape
from fleet.health import HealthState
from fleet.pool import PoolState, ReplicaState
from fleet.router import Reject, Route, RouterSettings, Wait, route
from fleet.router_steps import work_units
from gateway.adapters import engine_model, with_model
from gateway.config import UpstreamSettings
from gateway.engine_errors import context_exceeded, request_refused
from gateway.errors import ApiError, error_body, error_response, sse_error_event
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.pool_wait import PoolWaits
from gateway.restart_waits import RestartHolds
from gateway.retry_budget import RetryBudget
from gateway.runtime import Runtime
from gateway.stream_usage import UsageChunkFilter, asked_for_usage, upstream_body
from gateway.tracing import RequestTrace, UpstreamSpan, forwarded_trace_headers
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse

_DONE = b"data: [DONE]"
_USAGE_KEY = b'"completion_tokens":'
_PROMPT_KEY = b'"prompt_tokens":'
# usage.prompt_tokens_details.cached_tokens (sglang; vLLM with --enable-prompt-tokens-details; the emulator)
_CACHED_KEY = b'"cached_tokens":'
_MEDIA_TYPE = re.compile(r"[\x21-\x7e]+(?: ?;[\x20-\x7e]*)?")
_DIGITS = re.compile(rb"[ \t]*([0-9]+)")
# The Responses API's last event, whatever way the response ended; quoted, so a model's text (where
# quotes are escaped) cannot match. Its data holds the whole response: id, status and usage.
_RESPONSE_END = re.compile(rb'"response\.(?:completed|incomplete|failed)"')
_MAX_FINAL_EVENT_BYTES = 4 * 1024 * 1024
# An event's ``sequence_number`` member; inside a JSON string its quotes are escaped, so model text cannot match.
_SEQUENCE_NUMBER = re.compile(rb'(?<!\\)"sequence_number"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class Wire:
    """How the proxy speaks one endpoint: where the usage is, what ends a stream, what it may add."""

    prompt_key: bytes = _PROMPT_KEY
    completion_key: bytes = _USAGE_KEY
    ask_stream_usage: bool = True  # streams carry usage only when asked (stream_options): ask for it
    priority: bool = True  # send the tier's priority to engines that schedule by it
    array_ok: bool = False  # a 200 body may be a JSON array (sglang's /v1/rerank answers a list)
    events: bool = False  # a Responses stream: typed events ending in response.completed, not [DONE]


CHAT_WIRE = Wire()
# Pooling requests are over in one forward pass: no priority (sglang's pooling requests take none).
EMBEDDINGS_WIRE = Wire(ask_stream_usage=False, priority=False)
RESPONSES_WIRE = Wire(b'"input_tokens":', b'"output_tokens":', ask_stream_usage=False, events=True)
RERANK_WIRE = Wire(b'"total_tokens":', ask_stream_usage=False, priority=False, array_ok=True)  # vLLM's rerank usage has total_tokens only
SCORE_WIRE = Wire(ask_stream_usage=False, priority=False)


async def _next_chunk(upstream: UpstreamResponse, outcome: Outcome) -> bytes:
    """The stream's next piece; b"" at its end, or when it broke off (then ``outcome.stream_error`` says how)."""
    try:
        return await upstream.read_chunk()  # TimeoutError after between_chunks_timeout_s
    except TimeoutError:
        upstream.close()
        outcome.stream_error = "upstream_stalled"
    except UpstreamError:
        outcome.stream_error = "upstream_disconnected"
    return b""


def _count_stream(outcome: Outcome, tail: bytes, num_events: int, first_at: float, last_event_at: float) -> None:
    """A chat or completions stream's usage (from its last bytes, when the engine sent it) and TPOT."""
    outcome.prompt_tokens = _usage_int(tail, _PROMPT_KEY)
    outcome.completion_tokens = _usage_int(tail, _USAGE_KEY)
    outcome.cached_tokens = _usage_int(tail, _CACHED_KEY)
    num_tokens = outcome.completion_tokens or max(0, num_events - 2)
    if num_tokens > 1:
        outcome.tpot_s = (last_event_at - first_at) / (num_tokens - 1)


def _is_json_object(body: bytes, array_ok: bool = False) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) or (array_ok and isinstance(parsed, list))


def _read_response(response: object, outcome: Outcome) -> None:
    """Id and usage of a Responses API ``response`` object (the body, or the final event's)."""
    if not isinstance(response, dict):
        return
    response_id = response.get("id")
    outcome.response_id = response_id if isinstance(response_id, str) else None
    usage = response.get("usage")
    if isinstance(usage, dict):
        tokens_in, tokens_out = usage.get("input_tokens"), usage.get("output_tokens")
        outcome.prompt_tokens = tokens_in if isinstance(tokens_in, int) else None
        outcome.completion_tokens = tokens_out if isinstance(tokens_out, int) else None
        details = usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        outcome.cached_tokens = cached if isinstance(cached, int) else None


def engine_priority(pool: PoolState, tier_priority: int) -> int | None:
    """The ``priority`` to send ``pool``'s engines for a request of a tier with ``tier_priority``
    (0 is the most urgent), in the engine's own convention; None: send none.

    A client's own ``priority`` is overridden, not merged: the tenant's tier is what it pays for, and
    a client could otherwise jump the queue of every other tenant on the replica."""
    if not pool.priority_scheduling:
        return None
    if pool.engine_kind in ("sglang", "vllm", "emulated"):
        # One convention everywhere, lower values first, as the tiers count: vLLM's priority scheduler
        # does so; sglang runs higher values first by default (SchedulePolicy sorts by priority *
        # priority_sign, python/sglang/srt/managers/schedule_policy.py), so the pools Polymorph launches
        # get --schedule-low-priority-values-first (kernels.config), and an sglang the operator runs
        # behind `replicas: {urls: ...}` must be started with it too (README, Real engines).
        return tier_priority
    return None  # llama.cpp's server has no request priority


def _usage_int(data: bytes, key: bytes) -> int | None:
    at = data.rfind(key)
    if at < 0:
        return None
    found = _DIGITS.match(data, at + len(key))
    return int(found[1]) if found is not None else None


def _pinned_route(runtime: Runtime, shape: Shape, model: str, pinned: str, now: float, tried: list[str], last_error: ApiError | None) -> Route:
    """The route to ``pinned``, the only replica that can answer (it holds the request's state), or why not."""
    replica = runtime.replica_by_name.get(pinned)
    if replica is None or not replica.serves(model):
        raise ApiError(400, f"The previous response was produced by replica {pinned}, which no longer serves {model[:200]!r}; "
                       "its stored responses went with it.", "previous_response_not_found", "previous_response_id")
    if pinned in tried and last_error is not None:
        raise last_error  # no other replica holds the state: a failed attempt is the answer
    if not replica.routable(now):
        raise ApiError(503, f"Replica {pinned}, which holds the previous response, is not taking requests now.", "previous_response_unavailable",
                       retry_after_s=1.0)
    pool = next(p for p in runtime.pools if p.name == replica.pool)
    return Route(replica.pool, replica.name, replica.url, False, work_units(shape, pool))


def _responses_error_event(message: str, code: str, sequence_number: int) -> bytes:
    """The Responses API's ``error`` event, ending a stream that broke after its first byte; it is numbered
    after the last event the client got, as every event of the stream is."""
    error = orjson.loads(error_body(502, message, code))["error"]
    return b"event: error\ndata: " + orjson.dumps({**error, "type": "error", "sequence_number": sequence_number}) + b"\n\n"


class Proxy:
    """Sends requests to replicas over one shared keep-alive connection pool."""

    def __init__(self, pool: UpstreamPool, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self.waits = PoolWaits(metrics, RouterSettings())  # pools' queues; attached to each runtime as it goes live (with its router settings)
        self.holds = RestartHolds(metrics)  # requests held while every replica of their model restarts
        self.retry_budget = RetryBudget()

    async def forward(
        self,
        request: web.Request,
        runtime: Runtime,
        shape: Shape,
        model: str,
        raw_body: bytes,
        stream: bool,
        outcome: Outcome,
        body: Mapping[str, object],
        wire: Wire = CHAT_WIRE,
        pinned: str | None = None,
        trace: RequestTrace | None = None,
    ) -> web.StreamResponse:
        """Route and send one request; ``body`` is ``raw_body`` as the request path parsed it.

        ``wire`` says how the endpoint's answers read; ``pinned`` names the one replica that may take
        the request (it holds the state the request refers to), instead of the router's choice;
        ``trace`` (tracing on) gets the route, the queue wait and a span per attempt."""
        settings = runtime.config.upstream
        loop = asyncio.get_running_loop()
        tried: list[str] = []
        budget_tokens = shape.prompt_tokens + shape.predicted_output_p50
        self.retry_budget.on_request(loop.time())
        # A stream whose client did not ask for usage asks the engine anyway (and hides it again)
        strip_usage = stream and wire.ask_stream_usage and not asked_for_usage(body)
        tier = runtime.config.tiers.get(shape.tier)
        last_error: ApiError | None = None
        # tracing off: the client's own trace context goes on to the engine; on: each attempt's span's
        trace_headers = forwarded_trace_headers(request.headers) if trace is None else b""
        while True:
            now = loop.time()
            decision: Route | Wait | Reject
            if pinned is not None:
                decision = _pinned_route(runtime, shape, model, pinned, now, tried, last_error)
            else:
                # with the tiers, the router sheds the lowest tiers at once when every usable pool is full
                decision = route(shape, model, runtime.pools, now, runtime.config.router, tried, runtime.config.tiers)
            if isinstance(decision, Reject):
                # no replica serves the model now: if one is restarting, wait for it instead of failing
                if decision.code == "no_healthy_replica" and last_error is None and await self.holds.hold(model, shape.tier, tier, runtime.config):
                    runtime = self.waits.runtime or runtime
                    continue
                if last_error is not None:
                    raise last_error
                raise ApiError(decision.status, decision.reason, decision.code, "model" if decision.status == 404 else None, decision.retry_after_s or None)
            if isinstance(decision, Wait):  # its pool is saturated: wait in the pool's queue for a replica's room
                queue_span = trace.start_queue(decision) if trace is not None else None
                placed = None
                try:
                    placed = await self.waits.wait(decision, shape, model, tried, budget_tokens)
                finally:
                    if trace is not None and queue_span is not None:
                        trace.end_queue(queue_span, placed is not None)
                if placed is None:  # the pools changed and that one has no routable replica: route it again
                    runtime = self.waits.runtime or runtime
                    continue
                decision, replica = placed
            else:
                # taken from the pools the router chose among, not the runtime's name map: a replica that came
                # back after this request took its runtime is in those (shared) pools but not in that map
                replica = next(r for p in runtime.pools if p.name == decision.pool for r in p.replicas if r.name == decision.replica)
                if trace is not None:
                    trace.routed(runtime, shape, decision, now)
            pool = next((p for p in runtime.pools if p.name == decision.pool), None)
            priority = engine_priority(pool, tier.priority) if pool is not None and tier is not None and wire.priority else None
            sent_body = upstream_body(raw_body, body, strip_usage, priority)
            if runtime.adapter_base and pool is not None and (renamed := engine_model(pool.engine_kind, model, runtime.adapter_base.get(model))):
                sent_body = with_model(sent_body, renamed)
            outcome.pool, outcome.replica = decision.pool, decision.replica
            outcome.attempts += 1
            tried.append(replica.name)
            trial = replica.breaker.on_dispatch()
            replica.begin(budget_tokens, decision.work)  # an overflow from another shape weighs what the router weighed
            # an urgent request's time in flight is what the pool's urgent reserve is sized from (fleet.urgent_demand)
            demand = pool.urgent_demand if pool is not None and tier is not None and tier.priority < runtime.config.router.shed_priority else None
            if demand is not None:
                demand.begin(loop.time())
            gauge = self.metrics.child(self.metrics.in_flight, decision.pool)
            gauge.inc()
            share_mark = replica.share.begin(loop.time())
            span: UpstreamSpan | None = trace.start_upstream(decision, request.path) if trace is not None else None
            try:
                result = await self._attempt(request, decision, replica, sent_body, stream, strip_usage, shape, settings, outcome, wire,
                                             trace_headers if span is None else span.headers)
            except ApiError as err:
                last_error = err
                if span is not None:
                    span.end(err.status, err.code)
                if outcome.attempts >= settings.max_attempts or not self.retry_budget.try_spend(loop.time(), settings.retry_budget_ratio):
                    raise
                self.metrics.child(self.metrics.retries, decision.pool).inc()
                continue
            finally:
                replica.breaker.on_undecided(trial)  # a decided trial is past: this only frees an abandoned one
                if span is not None:
                    span.end(outcome.status, outcome.stream_error)
                replica.end(budget_tokens, decision.work)
                if demand is not None:
                    demand.end(loop.time())
                outcome.engine_share_s += replica.share.end(loop.time(), share_mark)
                gauge.dec()
                if self.waits.num_waiting:
                    self.waits.wake(replica.pool, loop.time())
            return result

    def _raise_if_context_exceeded(self, replica: ReplicaState, status: int, body: bytes, outcome: Outcome) -> None:
        """OpenAI's 400 ``context_length_exceeded`` for an engine's answer that the request's context does not
        fit there (gateway.engine_errors); ``forward`` retries it on another replica, which may hold it. The
        replica answered as a healthy one does: a success for its breaker (it may have been a probe)."""
        message = context_exceeded(status, body)
        if message is not None:
            self.mark_success(replica)
            outcome.status = 400
            raise ApiError(400, f"Replica {replica.name} cannot hold this request's context: {message}", "context_length_exceeded")

    def mark_failure(self, replica: ReplicaState) -> None:
        if replica.breaker.on_failure(asyncio.get_running_loop().time()):
            self.metrics.child(self.metrics.ejections, replica.pool, replica.name).inc()
            self.metrics.child(self.metrics.replica_up, replica.pool, replica.name).set(0)

    def mark_success(self, replica: ReplicaState) -> None:
        """A request served: the replica's run of failures is over."""
        if replica.breaker.state is not HealthState.HEALTHY:
            self.metrics.child(self.metrics.replica_up, replica.pool, replica.name).set(1)
        replica.breaker.on_success()

    def mark_probe_success(self, replica: ReplicaState, trial: int | None) -> None:
        """/health answered 200 to probe ``trial``: it readmits an ejected replica whose trial it was, and
        clears no failures (fleet.health.CircuitBreaker.on_probe_success)."""
        if replica.breaker.on_probe_success(trial):
            self.metrics.child(self.metrics.replica_up, replica.pool, replica.name).set(1)

    async def _attempt(
        self,
        request: web.Request,
        decision: Route,
        replica: ReplicaState,
        raw_body: bytes,
        stream: bool,
        strip_usage: bool,
        shape: Shape,
        settings: UpstreamSettings,
        outcome: Outcome,
        wire: Wire,
        trace_headers: bytes = b"",
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        timeout_s = settings.first_byte_timeout_s if stream else settings.response_timeout_s
        deadline = started_at + timeout_s
        try:
            # The deadline covers the head and the body (a stream: its first piece), on one timer.
            upstream = await self.pool.post(decision.url, request.path, raw_body, settings.connect_timeout_s, deadline, trace_headers)
        except TimeoutError:
            self.mark_failure(replica)
            raise ApiError(504, f"Replica {replica.name} did not answer within {timeout_s:g} s.", "upstream_timeout") from None
        except UpstreamError as exc:
            self.mark_failure(replica)
            raise ApiError(502, f"Replica {replica.name} could not be reached ({exc}).", "upstream_unreachable", retry_after_s=1.0) from None
        headers = {
            "x-polymorph-pool": decision.pool,
            "x-polymorph-replica": replica.name,
            "x-polymorph-shape": shape.name,
        }
        try:
            # 501: the engine does not implement this endpoint (llama-server's embeddings without
            # --embeddings): the client's answer, passed on, and no sign of a sick replica
            if (upstream.status >= 500 and upstream.status != 501) or upstream.status == 429:
                body = await upstream.read()
                self._raise_if_context_exceeded(replica, upstream.status, body, outcome)  # the request's fault: the replica is well
                if (refusal := request_refused(upstream.status, body)) is not None:  # so is this, and no replica would take it
                    self.mark_success(replica)
                    outcome.status = 400
                    return error_response(ApiError(400, f"Replica {replica.name} refused the request: {refusal}", "invalid_request"), headers)
                if upstream.status >= 500:
                    self.mark_failure(replica)
                outcome.status = upstream.status
                err = ApiError(upstream.status, f"Replica {replica.name} answered {upstream.status}: {body[:300].decode('utf-8', 'replace')}", "upstream_error", retry_after_s=1.0)
                raise err
            if stream and upstream.status == 200:
                usage_filter = UsageChunkFilter() if strip_usage else None
                return await self._stream(request, upstream, replica, headers, settings, started_at, outcome, usage_filter, wire.events)
            body = await upstream.read()
            self._raise_if_context_exceeded(replica, upstream.status, body, outcome)
        except TimeoutError:
            self.mark_failure(replica)
            raise ApiError(504, f"Replica {replica.name} did not answer within {timeout_s:g} s.", "upstream_timeout") from None
        except UpstreamError as exc:
            self.mark_failure(replica)
            raise ApiError(502, f"Replica {replica.name} failed before answering ({exc}).", "upstream_failed", retry_after_s=1.0) from None
        except BaseException:
            # The client went away (cancellation) or an error is on its way out: close the upstream
            # connection so the replica stops generating for nobody.
            upstream.close()
            raise
        finally:
            upstream.release()
        if upstream.status == 200 and not _is_json_object(body, wire.array_ok):
            self.mark_failure(replica)
            raise ApiError(502, f"Replica {replica.name} answered 200 with a body that is not a JSON object.", "upstream_invalid_response", retry_after_s=1.0)
        outcome.ttft_s = loop.time() - started_at
        outcome.status = upstream.status
        self.mark_success(replica)
        if upstream.status == 200:
            if wire.events:
                _read_response(orjson.loads(body), outcome)
            else:
                outcome.prompt_tokens = _usage_int(body, wire.prompt_key)
                outcome.completion_tokens = _usage_int(body, wire.completion_key)
                outcome.cached_tokens = _usage_int(body, _CACHED_KEY)
        content_type = upstream.headers.get("content-type", "")
        # Only a plain media type is passed on: a replica's control characters must not reach our headers.
        headers["Content-Type"] = content_type if _MEDIA_TYPE.fullmatch(content_type) else "application/json"
        return web.Response(status=upstream.status, body=body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        replica: ReplicaState,
        headers: dict[str, str],
        settings: UpstreamSettings,
        started_at: float,
        outcome: Outcome,
        usage_filter: UsageChunkFilter | None,
        events: bool = False,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        # The first chunk decides whether this attempt can still be retried: read it (within the
        # first-byte deadline) before answering; then each next chunk has its own time limit.
        first = await upstream.read_chunk()
        upstream.limit_gaps(settings.between_chunks_timeout_s)
        first_at = loop.time()
        outcome.ttft_s = first_at - started_at
        outcome.status = 200
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        response = web.StreamResponse(status=200, headers=headers)
        try:
            await response.prepare(request)
            if events:
                await self._relay_events(response, upstream, first, first_at, replica, outcome)
            else:
                await self._relay(response, upstream, first, first_at, replica, outcome, usage_filter)
            await response.write_eof()
        except ConnectionError:
            # The client went away: not the replica's fault. Stop its generation and say nothing.
            upstream.close()
            outcome.stream_error = "client_disconnected"
        return response

    async def _relay(
        self,
        response: web.StreamResponse,
        upstream: UpstreamResponse,
        first: bytes,
        first_at: float,
        replica: ReplicaState,
        outcome: Outcome,
        usage_filter: UsageChunkFilter | None,
    ) -> None:
        """Copy the replica's events to the client; a broken upstream ends with an SSE error event.

        With ``usage_filter``, the usage-only chunk the gateway asked for is left out of what the client
        gets; the tail (whence the usage is read) is taken from the replica's bytes either way."""
        loop = asyncio.get_running_loop()
        num_events = 0
        last_event_at = first_at
        chunk = first
        tail = b""
        try:
            while chunk:
                num_events += chunk.count(b"data:")
                last_event_at = loop.time()
                tail = (tail + chunk[-512:])[-512:]
                passed = chunk if usage_filter is None else usage_filter.feed(chunk)
                if passed:
                    await response.write(passed)
                chunk = await _next_chunk(upstream, outcome)
        except asyncio.CancelledError:
            # The handler is cancelled when its client leaves. A client that read [DONE] often closes
            # before the replica's end of stream arrives: that stream was whole, and what it carried counts.
            upstream.close()
            if _DONE not in tail:
                outcome.stream_error = "client_disconnected"
            else:
                self.mark_success(replica)  # the replica sent the whole stream (it may have been its trial)
            _count_stream(outcome, tail, num_events, first_at, last_event_at)
            raise
        if outcome.stream_error is None and _DONE not in tail:
            outcome.stream_error = "upstream_truncated"
        if usage_filter is not None and (rest := usage_filter.flush()):
            await response.write(rest)
        if outcome.stream_error is not None:
            self.mark_failure(replica)
            message = f"The stream from replica {replica.name} broke off ({outcome.stream_error}); the response is incomplete."
            await response.write(sse_error_event(message, outcome.stream_error))
        else:
            self.mark_success(replica)
        _count_stream(outcome, tail, num_events, first_at, last_event_at)

    async def _relay_events(
        self,
        response: web.StreamResponse,
        upstream: UpstreamResponse,
        first: bytes,
        first_at: float,
        replica: ReplicaState,
        outcome: Outcome,
    ) -> None:
        """Copy a Responses API stream to the client; it ends with its ``response.completed`` (or
        ``.incomplete``/``.failed``) event, whose data carries the response's id and usage. That
        event holds the whole output, so it is kept from its ``data:`` line on (bounded)."""
        loop = asyncio.get_running_loop()
        last_event_at = first_at
        chunk = first
        carry = b""  # the end of the bytes before, in case the end marker or a sequence number straddles two reads
        final: bytearray | None = None
        next_sequence_number = 0
        while chunk:
            last_event_at = loop.time()
            data = carry + chunk
            if numbers := _SEQUENCE_NUMBER.findall(data):
                next_sequence_number = max(next_sequence_number, int(numbers[-1]) + 1)
            if final is None:
                found = _RESPONSE_END.search(data)
                if found is not None:
                    start = data.rfind(b"data:", 0, found.start())
                    final = bytearray(data[start if start >= 0 else found.start() :])
            elif len(final) < _MAX_FINAL_EVENT_BYTES:
                final += chunk
            carry = data[-64:]
            await response.write(chunk)
            chunk = await _next_chunk(upstream, outcome)
        if outcome.stream_error is None and final is None:
            outcome.stream_error = "upstream_truncated"
        if outcome.stream_error is not None:
            self.mark_failure(replica)
            message = f"The stream from replica {replica.name} broke off ({outcome.stream_error}); the response is incomplete."
            await response.write(_responses_error_event(message, outcome.stream_error, next_sequence_number))
            return
        self.mark_success(replica)
        assert final is not None
        line = bytes(final).split(b"\n", 1)[0]
        try:
            event = orjson.loads(line[5:]) if line.startswith(b"data:") else None
        except orjson.JSONDecodeError:
            event = None
        if isinstance(event, dict):
            _read_response(event.get("response"), outcome)
        if outcome.completion_tokens is not None and outcome.completion_tokens > 1:
            outcome.tpot_s = (last_event_at - first_at) / (outcome.completion_tokens - 1)

