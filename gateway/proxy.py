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
from gateway.admission import RetryBudget
from gateway.config import UpstreamSettings
from gateway.errors import ApiError, sse_error_event
from gateway.metrics import GatewayMetrics
from gateway.pool_wait import PoolWaits
from gateway.runtime import Runtime
from gateway.stream_usage import UsageChunkFilter, asked_for_usage, upstream_body
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse

_DONE = b"data: [DONE]"
_USAGE_KEY = b'"completion_tokens":'
_PROMPT_KEY = b'"prompt_tokens":'
_MEDIA_TYPE = re.compile(r"[\x21-\x7e]+(?: ?;[\x20-\x7e]*)?")
_DIGITS = re.compile(rb"[ \t]*([0-9]+)")


@dataclass(slots=True)
class Outcome:
    """What happened to one proxied request; filled in as it goes, read by metrics and the access log."""

    pool: str = "-"
    replica: str = "-"
    status: int = 0
    attempts: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    stream_error: str | None = None


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


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


class Proxy:
    """Sends requests to replicas over one shared keep-alive connection pool."""

    def __init__(self, pool: UpstreamPool, metrics: GatewayMetrics, settings: UpstreamSettings, now: float) -> None:
        self.pool = pool
        self.metrics = metrics
        self.waits = PoolWaits(metrics, RouterSettings())  # pools' queues; attached to each runtime as it goes live (with its router settings)
        self.retry_budget = RetryBudget(settings.retry_budget_ratio, now)

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
    ) -> web.StreamResponse:
        """Route and send one request; ``body`` is ``raw_body`` as the request path parsed it."""
        settings = runtime.config.upstream
        loop = asyncio.get_running_loop()
        tried: list[str] = []
        budget_tokens = shape.prompt_tokens + shape.predicted_output_p50
        self.retry_budget.on_request()
        # A stream whose client did not ask for usage asks the engine anyway (and hides it again)
        strip_usage = stream and not asked_for_usage(body)
        tier = runtime.config.tiers.get(shape.tier)
        last_error: ApiError | None = None
        while True:
            now = loop.time()
            # with the tiers, the router sheds the lowest tiers at once when every usable pool is full
            decision = route(shape, model, runtime.pools, now, runtime.config.router, tried, runtime.config.tiers)
            if isinstance(decision, Reject):
                if last_error is not None:
                    raise last_error
                raise ApiError(decision.status, decision.reason, decision.code, "model" if decision.status == 404 else None, decision.retry_after_s or None)
            if isinstance(decision, Wait):  # its pool is saturated: wait in the pool's queue for a replica's room
                placed = await self.waits.wait(decision, shape, model, tried, budget_tokens)
                if placed is None:  # the pools changed and that one has no routable replica: route it again
                    runtime = self.waits.runtime or runtime
                    continue
                decision, replica = placed
            else:
                replica = runtime.replica_by_name[decision.replica]
            pool = next((p for p in runtime.pools if p.name == decision.pool), None)
            priority = engine_priority(pool, tier.priority) if pool is not None and tier is not None else None
            sent_body = upstream_body(raw_body, body, strip_usage, priority)
            outcome.pool, outcome.replica = decision.pool, decision.replica
            outcome.attempts += 1
            tried.append(replica.name)
            replica.breaker.on_dispatch()
            replica.begin(budget_tokens, decision.work)  # an overflow from another shape weighs what the router weighed
            gauge = self.metrics.child(self.metrics.in_flight, decision.pool)
            gauge.inc()
            try:
                result = await self._attempt(request, decision, replica, sent_body, stream, strip_usage, shape, settings, outcome)
            except ApiError as err:
                last_error = err
                if outcome.attempts >= settings.max_attempts or not self.retry_budget.try_spend(loop.time()):
                    raise
                self.metrics.child(self.metrics.retries, decision.pool).inc()
                continue
            finally:
                replica.end(budget_tokens, decision.work)
                gauge.dec()
                if self.waits.num_waiting:
                    self.waits.wake(replica.pool, loop.time())
            return result

    def mark_failure(self, replica: ReplicaState) -> None:
        if replica.breaker.on_failure(asyncio.get_running_loop().time()):
            self.metrics.child(self.metrics.ejections, replica.pool, replica.name).inc()
            self.metrics.child(self.metrics.replica_up, replica.pool, replica.name).set(0)

    def mark_success(self, replica: ReplicaState) -> None:
        if replica.breaker.state is not HealthState.HEALTHY:
            self.metrics.child(self.metrics.replica_up, replica.pool, replica.name).set(1)
        replica.breaker.on_success()

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
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        first_byte_deadline = started_at + settings.first_byte_timeout_s
        try:
            # The deadline covers the head and the body (a stream: its first piece), on one timer.
            upstream = await self.pool.post(decision.url, request.path, raw_body, settings.connect_timeout_s, first_byte_deadline)
        except TimeoutError:
            self.mark_failure(replica)
            raise ApiError(504, f"Replica {replica.name} did not answer within {settings.first_byte_timeout_s:g} s.", "upstream_timeout") from None
        except UpstreamError as exc:
            self.mark_failure(replica)
            raise ApiError(502, f"Replica {replica.name} could not be reached ({exc}).", "upstream_unreachable", retry_after_s=1.0) from None
        headers = {
            "x-polymorph-pool": decision.pool,
            "x-polymorph-replica": replica.name,
            "x-polymorph-shape": shape.name,
        }
        try:
            if upstream.status >= 500 or upstream.status == 429:
                body = await upstream.read()
                if upstream.status >= 500:
                    self.mark_failure(replica)
                outcome.status = upstream.status
                err = ApiError(upstream.status, f"Replica {replica.name} answered {upstream.status}: {body[:300].decode('utf-8', 'replace')}", "upstream_error", retry_after_s=1.0)
                raise err
            if stream and upstream.status == 200:
                usage_filter = UsageChunkFilter() if strip_usage else None
                return await self._stream(request, upstream, replica, headers, settings, started_at, outcome, usage_filter)
            body = await upstream.read()
        except TimeoutError:
            self.mark_failure(replica)
            raise ApiError(504, f"Replica {replica.name} did not answer within {settings.first_byte_timeout_s:g} s.", "upstream_timeout") from None
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
        if upstream.status == 200 and not _is_json_object(body):
            self.mark_failure(replica)
            raise ApiError(502, f"Replica {replica.name} answered 200 with a body that is not a JSON object.", "upstream_invalid_response", retry_after_s=1.0)
        outcome.ttft_s = loop.time() - started_at
        outcome.status = upstream.status
        self.mark_success(replica)
        if upstream.status == 200:
            outcome.prompt_tokens = _usage_int(body, _PROMPT_KEY)
            outcome.completion_tokens = _usage_int(body, _USAGE_KEY)
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
        while chunk:
            num_events += chunk.count(b"data:")
            last_event_at = loop.time()
            tail = (tail + chunk[-512:])[-512:]
            passed = chunk if usage_filter is None else usage_filter.feed(chunk)
            if passed:
                await response.write(passed)
            try:
                chunk = await upstream.read_chunk()  # TimeoutError after between_chunks_timeout_s
            except TimeoutError:
                upstream.close()
                outcome.stream_error = "upstream_stalled"
                break
            except UpstreamError:
                outcome.stream_error = "upstream_disconnected"
                break
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
        outcome.prompt_tokens = _usage_int(tail, _PROMPT_KEY)
        outcome.completion_tokens = _usage_int(tail, _USAGE_KEY)
        num_tokens = outcome.completion_tokens or max(0, num_events - 2)
        if num_tokens > 1:
            outcome.tpot_s = (last_event_at - first_at) / (num_tokens - 1)
