"""OpenTelemetry tracing through the gateway: a request's span with the route decision and its child
spans (in memory, and over OTLP/HTTP to a loopback collector), the W3C trace context the engine
receives with tracing on and off, and OpenTelemetry left unimported when tracing is off."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.app import build_app
from gateway.config import load_config
from kernels.yamlsrc import ConfigError
from tests.conftest import REPO, free_port
from tests.support.procs import start, start_emulator, write_tenant

MODEL = "llama-3.1-8b"
KEY = "sk-test-tracing"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
T = TypeVar("T")


class _Loop:
    """An event loop in a thread: the in-process gateway and the fake engine run there, the SDK client here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class _Engine:
    """A small OpenAI-compatible engine that records the headers of each completion request."""

    seen: list[dict[str, str]] = field(default_factory=list)
    num_failing: int = 0  # answer the first requests 503 (a retry's first attempt)
    holding: bool = False  # keep the requests waiting until the test lets them go (a pool queue fills)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        if len(self.seen) <= self.num_failing:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        while self.holding:
            await asyncio.sleep(0.01)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if not body.get("stream"):
            return web.json_response({"id": "c1", "object": "chat.completion", "created": 0, "model": MODEL, "usage": usage,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delta in ("hi", " there"):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        final = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [], "usage": usage}
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True)  # as `polymorph serve` runs the gateway: a client gone cancels its handler
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _config(tmp_path: Path, engine_url: str, tracing: object = None, num_replicas: int = 1, **pool: object) -> Path:
    (tmp_path / "tenants").mkdir(exist_ok=True)
    write_tenant(tmp_path / "tenants", "apps", KEY)
    config: dict[str, object] = {
        "server": {"host": "127.0.0.1", "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {"pools": [{"name": "main", "model": MODEL, "replicas": {"urls": [engine_url] * num_replicas}, **pool}]},
    }
    if tracing is not None:
        config["tracing"] = tracing
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config, indent=1))  # one field a line: a config error's line names its field
    return path


@dataclass
class _Gateway:
    url: str
    engine: _Engine


@contextmanager
def _gateway(tmp_path: Path, exporter: InMemorySpanExporter | None, engine: _Engine | None = None, num_replicas: int = 1,
             **pool: object) -> Iterator[_Gateway]:
    """A gateway app in this process (tracing on with ``exporter``, else off) before a fake engine; the
    spans are flushed to the exporter when the block ends (the app's cleanup shuts the tracer down)."""
    loop, engine = _Loop(), engine or _Engine()
    engine_port, gateway_port = free_port(), free_port()
    runners: list[web.AppRunner] = []
    try:
        runners.append(loop.run(_serve(engine.app(), engine_port)))
        tracing = {"enabled": True} if exporter is not None else None
        config = load_config(_config(tmp_path, f"http://127.0.0.1:{engine_port}", tracing, num_replicas, **pool))
        runners.append(loop.run(_serve(build_app(config, span_exporter=exporter), gateway_port)))
        yield _Gateway(f"http://127.0.0.1:{gateway_port}", engine)
    finally:
        for runner in reversed(runners):
            loop.run(runner.cleanup())
        loop.close()


def _client(gateway: _Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _chat(gateway: _Gateway, headers: dict[str, str], stream: bool = False) -> str:
    client = _client(gateway)
    messages: Any = [{"role": "user", "content": "Say hi"}]
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_headers=headers).choices[0].message.content or ""
    pieces = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, extra_headers=headers)
    return "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)


def _children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_span_carries_the_route_and_the_engine_gets_the_upstream_span_as_parent(tmp_path: Path, stream: bool) -> None:
    exporter = InMemorySpanExporter()
    with _gateway(tmp_path, exporter) as gateway:
        assert _chat(gateway, {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}, stream) == "hi there"
    spans = exporter.get_finished_spans()
    [request] = [s for s in spans if s.kind is SpanKind.SERVER]
    assert request.name == "POST /v1/chat/completions"
    assert request.context is not None and request.parent is not None
    assert f"{request.context.trace_id:032x}" == TRACE_ID and f"{request.parent.span_id:016x}" == CLIENT_SPAN_ID
    attrs = dict(request.attributes or {})
    assert attrs["polymorph.tenant"] == "apps" and attrs["polymorph.pool"] == "main" and attrs["polymorph.replica"] == "main-0"
    assert attrs["gen_ai.request.model"] == MODEL and attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.usage.input_tokens"] == 5 and attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["polymorph.retries"] == 0 and attrs["polymorph.queue_wait_s"] == 0.0
    assert isinstance(attrs["polymorph.shape"], str) and isinstance(attrs["polymorph.domain"], str) and isinstance(attrs["polymorph.tier"], str)
    assert 0.0 <= float(attrs["polymorph.slo_chance"]) <= 1.0  # type: ignore[arg-type]
    assert request.status.status_code is not StatusCode.ERROR
    children = _children(spans, request)
    assert set(children) == {"polymorph.classify", "polymorph.upstream"}  # no queue: the pool was not saturated
    assert (children["polymorph.classify"].attributes or {})["polymorph.shape"] == attrs["polymorph.shape"]
    upstream = children["polymorph.upstream"]
    assert upstream.kind is SpanKind.CLIENT and (upstream.attributes or {})["http.response.status_code"] == 200
    assert upstream.context is not None
    [seen] = gateway.engine.seen
    assert seen["traceparent"] == f"00-{TRACE_ID}-{upstream.context.span_id:016x}-01"  # the engine's spans hang under our attempt
    assert seen["tracestate"] == "vendor=1"


def test_an_unknown_model_gives_an_error_span_and_no_upstream_call(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    with _gateway(tmp_path, exporter) as gateway:
        with pytest.raises(openai.NotFoundError):
            _client(gateway).chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert gateway.engine.seen == []
    spans = exporter.get_finished_spans()
    [request] = spans  # refused before classification: the request span alone
    assert request.status.status_code is StatusCode.ERROR and (request.attributes or {})["http.response.status_code"] == 404
    assert request.parent is None  # no traceparent came: the trace starts here


def test_a_retried_request_has_a_span_per_attempt_and_counts_its_retry(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    with _gateway(tmp_path, exporter, _Engine(num_failing=1), num_replicas=2) as gateway:
        assert _chat(gateway, {}) == "hi there"
    spans = exporter.get_finished_spans()
    [request] = [s for s in spans if s.kind is SpanKind.SERVER]
    attempts = sorted((s for s in spans if s.name == "polymorph.upstream"), key=lambda s: s.start_time or 0)
    assert (request.attributes or {})["polymorph.retries"] == 1 and len(attempts) == 2
    assert [(a.attributes or {})["http.response.status_code"] for a in attempts] == [503, 200]
    assert [a.status.status_code for a in attempts] == [StatusCode.ERROR, StatusCode.UNSET]
    assert (attempts[1].attributes or {})["polymorph.replica"] == (request.attributes or {})["polymorph.replica"]
    # each attempt told the engine its own span
    assert [seen["traceparent"].split("-")[2] for seen in gateway.engine.seen] == [f"{a.context.span_id:016x}" for a in attempts if a.context]


def test_a_request_that_waits_in_its_pool_queue_gets_a_queue_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    engine = _Engine(holding=True)
    with _gateway(tmp_path, exporter, engine, max_in_flight_per_replica=1) as gateway, ThreadPoolExecutor(2) as pool:
        batch = {"x-polymorph-tier": "batch"}  # a long wait budget: the queued request is not shed while the test looks
        first = pool.submit(_chat, gateway, batch)
        _until(lambda: len(engine.seen) == 1)
        second = pool.submit(_chat, gateway, batch)
        _until(lambda: 'polymorph_pool_queue_depth{pool="main",tier="batch"} 1.0' in _get(gateway.url + "/metrics"))
        engine.holding = False
        assert first.result(30) == second.result(30) == "hi there"
    spans = exporter.get_finished_spans()
    queues = [s for s in spans if s.name == "polymorph.queue"]
    assert len(queues) == 1 and queues[0].parent is not None
    [waited] = [s for s in spans if s.context is not None and s.context.span_id == queues[0].parent.span_id]
    attrs = dict(waited.attributes or {})
    assert attrs["polymorph.queue_wait_s"] == (queues[0].attributes or {})["polymorph.queue_wait_s"]
    assert float(attrs["polymorph.queue_wait_s"]) > 0  # type: ignore[arg-type]
    assert "polymorph.slo_chance" in attrs and attrs["polymorph.tier"] == "batch"


def test_a_request_whose_client_goes_away_still_ends_its_spans(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    engine = _Engine(holding=True)
    with _gateway(tmp_path, exporter, engine) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=2)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert len(engine.seen) == 1  # it was waiting on the engine when the client gave up
        _until(lambda: 'polymorph_requests_in_flight{pool="main"} 0.0' in _get(gateway.url + "/metrics"))  # the handler was cancelled
        engine.holding = False
    spans = exporter.get_finished_spans()
    [request] = [s for s in spans if s.kind is SpanKind.SERVER]
    [upstream] = [s for s in spans if s.name == "polymorph.upstream"]
    assert request.status.status_code is StatusCode.ERROR and "http.response.status_code" not in (request.attributes or {})
    assert upstream.status.status_code is StatusCode.ERROR and (request.attributes or {})["polymorph.replica"] == "main-0"


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true within 20 s"
        time.sleep(0.02)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize(("sent", "forwarded"), [
    ({"traceparent": TRACEPARENT, "tracestate": "vendor=1"}, {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}),
    ({"traceparent": "00-not-hex-01", "tracestate": "vendor=1"}, {}),
    ({"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01"}, {}),  # an all-zero trace id is invalid
    ({}, {}),
])
def test_tracing_off_passes_a_valid_client_traceparent_on_unchanged(tmp_path: Path, sent: dict[str, str], forwarded: dict[str, str]) -> None:
    with _gateway(tmp_path, None) as gateway:
        _chat(gateway, sent)
    [seen] = gateway.engine.seen
    assert {k: v for k, v in seen.items() if k in ("traceparent", "tracestate")} == forwarded


@pytest.mark.parametrize("enabled", [False, True])
def test_opentelemetry_is_imported_only_when_tracing_is_on(tmp_path: Path, enabled: bool) -> None:
    path = _config(tmp_path, "http://127.0.0.1:9", {"enabled": enabled})
    code = ("import sys; from pathlib import Path; from gateway.app import build_app; from gateway.config import load_config; "
            f"build_app(load_config(Path({str(path)!r}))); print('opentelemetry' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(enabled)


def test_a_bad_sample_ratio_is_a_config_error_naming_its_line(tmp_path: Path) -> None:
    path = _config(tmp_path, "http://127.0.0.1:9", {"enabled": True, "sample_ratio": 2})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "tracing.sample_ratio" and info.value.file == str(path) and "between 0 and 1" in info.value.reason
    assert path.read_text().splitlines()[info.value.line - 1].strip().startswith('"sample_ratio"')  # type: ignore[operator]


def test_spans_reach_an_otlp_collector_from_a_polymorph_serve_process(tmp_path: Path) -> None:
    received: list[ExportTraceServiceRequest] = []
    tokens: list[str] = []  # the configured headers each export carried

    async def collect(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        tokens.append(request.headers.get("x-collector-token", ""))
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector_app = web.Application()
    collector_app.router.add_post("/v1/traces", collect)
    loop, collector_port, gateway_port = _Loop(), free_port(), free_port()
    emulator = start_emulator(tmp_path, "emu")
    collector = loop.run(_serve(collector_app, collector_port))
    try:
        tracing = {"enabled": True, "otlp_endpoint": f"http://127.0.0.1:{collector_port}/v1/traces", "service_name": "polymorph-test",
                   "headers": {"x-collector-token": "t0ken"}}
        path = _config(tmp_path, emulator.url, tracing)
        # a short batch delay: the spans leave within a tenth of a second, not the SDK's default 5 s
        gateway = start(["serve", "--config", str(path), "--port", str(gateway_port)], gateway_port, tmp_path / "gateway.log", "/healthz",
                        env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            _chat(_Gateway(gateway.url, _Engine()), {"traceparent": TRACEPARENT})
            deadline = time.monotonic() + 20
            while not any(s.name == "polymorph.upstream" for s in _otlp_spans(received)) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            gateway.stop()
    finally:
        loop.run(collector.cleanup())
        loop.close()
        emulator.stop()
    spans = {s.name: s for s in _otlp_spans(received)}
    assert {"POST /v1/chat/completions", "polymorph.classify", "polymorph.upstream"} <= set(spans)
    request = spans["POST /v1/chat/completions"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == CLIENT_SPAN_ID
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["polymorph.pool"].string_value == "main" and attrs["http.response.status_code"].int_value == 200
    resources = {a.key: a.value.string_value for r in received for rs in r.resource_spans for a in rs.resource.attributes}
    assert resources["service.name"] == "polymorph-test" and set(tokens) == {"t0ken"}


def _otlp_spans(received: list[ExportTraceServiceRequest]) -> list[Any]:
    return [span for message in list(received) for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans]
