"""OpenTelemetry spans for the request path, and W3C trace context passed on to the engines.

With ``tracing.enabled`` each request gets a SERVER span (a child of the client's ``traceparent``
when one came) carrying the route decision, with child spans for classification, the wait in a pool
queue and one CLIENT span per upstream attempt; the engine gets that attempt's ``traceparent`` so its
own spans hang under ours. Spans leave in batches over OTLP/HTTP from the SDK's exporter thread.

Tracing off costs nothing of OpenTelemetry: it is imported only by ``build_tracer`` when enabled, the
request path checks ``tracer is None`` once, and a client's valid ``traceparent`` (with its
``tracestate``) is passed on to the engine as it came.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from classifiers.shape import Shape
from fleet.router import Route, Wait, request_slots, slo_chance
from gateway.config import TracingSettings
from gateway.outcome import Outcome
from gateway.runtime import Runtime
from kernels.tiers import DEFAULT_TIERS, slo_for

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# W3C Trace Context, version 00: version-traceid-parentid-flags in lowercase hex; all-zero ids are invalid.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")  # passed on opaque, but only printable and bounded
INSTALL_HINT = "pip install 'polymorph[tracing]'"


def forwarded_trace_headers(headers: Mapping[str, str]) -> bytes:
    """The header lines passing a client's trace context on to the engine untouched (tracing off):
    its ``traceparent`` if well-formed, with its ``tracestate``; nothing for a malformed one."""
    parent = headers.get("traceparent")
    if parent is None or not _TRACEPARENT.fullmatch(parent):
        return b""
    state = headers.get("tracestate")
    if state is None or not _TRACESTATE.fullmatch(state):
        return b"traceparent: %s\r\n" % parent.encode("ascii")
    return b"traceparent: %s\r\ntracestate: %s\r\n" % (parent.encode("ascii"), state.encode("ascii"))


def _status_of(span: Span, status: int, description: str | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if status >= 400 or status == 0:  # 0: no answer at all (a timeout, the client gone)
        span.set_status(Status(StatusCode.ERROR, description or (f"HTTP {status}" if status else "no answer")))


class UpstreamSpan:
    """One attempt's CLIENT span and the header lines that carry its context to the engine."""

    __slots__ = ("span", "headers", "_ended")

    def __init__(self, span: Span, headers: bytes) -> None:
        self.span = span
        self.headers = headers
        self._ended = False

    def end(self, status: int, description: str | None = None) -> None:
        """Close the span with the attempt's HTTP status (0: none came); later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        if status:
            self.span.set_attribute("http.response.status_code", status)
        _status_of(self.span, status, description)
        self.span.end()


class RequestTrace:
    """The spans of one request; the proxy and the handler report into it as the request goes."""

    __slots__ = ("_tracer", "_propagator", "span", "_context", "queue_wait_s", "slo_chance", "_queued_at")

    def __init__(self, tracer: Tracer, propagator: TraceContextTextMapPropagator, span: Span, context: Context) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self.span = span
        self._context = context  # the request span's: parent of the child spans
        self.queue_wait_s = 0.0
        self.slo_chance: float | None = None
        self._queued_at = 0.0

    def start_classify(self) -> Span:
        return self._tracer.start_span("polymorph.classify", context=self._context)

    def end_classify(self, span: Span, shape: Shape) -> None:
        span.set_attributes({"polymorph.shape": shape.name, "polymorph.domain": shape.domain, "polymorph.prompt_tokens": shape.prompt_tokens})
        span.end()

    def start_queue(self, decision: Wait) -> Span:
        """The request parks in ``decision.pool``'s queue; the router's chance is the one it queued with."""
        self.slo_chance = decision.slo_chance
        self._queued_at = time.monotonic()
        return self._tracer.start_span("polymorph.queue", context=self._context, attributes={"polymorph.pool": decision.pool, "polymorph.priority": decision.priority})

    def end_queue(self, span: Span, placed: bool) -> None:
        waited_s = time.monotonic() - self._queued_at
        self.queue_wait_s += waited_s
        span.set_attributes({"polymorph.queue_wait_s": waited_s, "polymorph.placed": placed})
        span.end()

    def routed(self, runtime: Runtime, shape: Shape, decision: Route, now: float) -> None:
        """The router's predicted chance that the request meets its tier's SLO in the pool it was sent to
        (its closed form, as the pool scorer ranks pools; computed here only because tracing is on)."""
        pool = next((p for p in runtime.pools if p.name == decision.pool), None)
        if pool is None:
            return
        slo = slo_for(runtime.config.tiers or DEFAULT_TIERS, shape.tier)
        settings = runtime.config.router
        slots = request_slots(pool, shape, slo, settings, now)
        self.slo_chance = slo_chance(pool, now, slo.priority, settings.wait_share * slo.ttft_p99_s, decision.work, slots)

    def start_upstream(self, decision: Route, path: str) -> UpstreamSpan:
        from opentelemetry.trace import SpanKind, set_span_in_context

        url = decision.url + path
        span = self._tracer.start_span(
            "polymorph.upstream", context=self._context, kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "url.full": url, "polymorph.pool": decision.pool, "polymorph.replica": decision.replica},
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return UpstreamSpan(span, b"".join(b"%s: %s\r\n" % (k.encode("ascii"), v.encode("ascii")) for k, v in carrier.items()))

    def finish(self, status: int, tenant: str, tier: str, model: str, shape: Shape | None, outcome: Outcome) -> None:
        """End the request span with what happened; ``status`` 0: no answer (the client went away)."""
        span = self.span
        attributes: dict[str, str | int | float] = {
            "polymorph.tenant": tenant,
            "polymorph.tier": tier,
            "gen_ai.request.model": model,
            "polymorph.pool": outcome.pool,
            "polymorph.replica": outcome.replica,
            "polymorph.queue_wait_s": self.queue_wait_s,
            "polymorph.retries": max(0, outcome.attempts - 1),
        }
        if status:
            attributes["http.response.status_code"] = status
        if shape is not None:
            attributes["polymorph.shape"] = shape.name
            attributes["polymorph.domain"] = shape.domain
        if self.slo_chance is not None:
            attributes["polymorph.slo_chance"] = self.slo_chance
        if outcome.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = outcome.prompt_tokens
        if outcome.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = outcome.completion_tokens
        if outcome.stream_error is not None:
            attributes["polymorph.stream_error"] = outcome.stream_error
        span.set_attributes(attributes)
        _status_of(span, status, outcome.stream_error or (None if status else "the client went away"))
        span.end()


class RequestTracer:
    """The tracer the gateway process started with (a reload keeps it) and its provider, flushed at cleanup."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("polymorph.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, method: str, path: str, headers: Mapping[str, str]) -> RequestTrace:
        """The request's SERVER span, a child of the client's trace context when it sent a valid one."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": path})
        return RequestTrace(self.tracer, self.propagator, span, set_span_in_context(span))

    async def shutdown(self) -> None:
        """Flush the spans still batched and stop the exporter (a blocking call: off the event loop)."""
        await asyncio.to_thread(self.provider.shutdown)


def build_tracer(settings: TracingSettings, exporter: SpanExporter | None = None) -> RequestTracer | None:
    """The process's tracer, or None when tracing is off; ``exporter`` replaces OTLP (tests: in memory)."""
    if not settings.enabled:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise RuntimeError(f"tracing.enabled needs the OpenTelemetry packages ({exc}): {INSTALL_HINT}") from None
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, headers=dict(settings.headers))
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return RequestTracer(provider)
