"""The aiohttp application: the OpenAI-compatible endpoints, health, metrics and the admin API.

A request goes: authenticate -> tier -> read and validate the body -> classify -> admit -> proxy ->
record. Every refusal is an OpenAI error envelope with the right status; nothing raises past a handler.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from classifiers.shape import Shape
from gateway.adapters import listed_adapters
from gateway.admin import AdminHandlers
from gateway.admission import Limiter
from gateway.bearer import bearer_token
from gateway.budgets import budget_refusal
from gateway.config import GatewayConfig, Tenant
from gateway.costs import request_cost_usd
from gateway.dashboard import add_dashboard_routes, is_admin_request
from gateway.endpoints import CHAT_METER, COMPLETIONS_METER, EMBEDDINGS, RERANK, RERANK_PATHS, RESPONSES, SCORE, SCORE_PATHS, Endpoint, Meter
from gateway.engine_scrape import EngineScraper
from gateway.errors import ApiError, error_response, unreadable_body
from gateway.metrics import CONTENT_TYPE
from gateway.openapi import DOCUMENT_BYTES
from gateway.outcome import Outcome
from gateway.probes import HealthProber
from gateway.proxy import Proxy
from gateway.response_ids import ResponseIds
from gateway.response_lookup import find_stored
from gateway.runtime import Runtime
from gateway.state import FleetLink, GatewayState
from gateway.tracing import RequestTrace, RequestTracer, build_tracer
from gateway.upstream import UpstreamPool
from gateway.validate import validate_body

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

_JSON = "application/json"
_UNAUTHENTICATED = "_unauthenticated"
CLIENT_CLOSED = 499  # nginx's status for a client that closed before its answer began
STATE_KEY: web.AppKey[GatewayState] = web.AppKey("polymorph_state")
ENGINE_SCRAPER_KEY: web.AppKey[EngineScraper] = web.AppKey("polymorph_engine_scraper")
PROBER_KEY: web.AppKey[HealthProber] = web.AppKey("polymorph_prober")


def _authenticate(request: web.Request, runtime: Runtime) -> Tenant:
    headers = request.headers.getall("Authorization", ())
    if len(headers) > 1:
        raise ApiError(400, "Send exactly one Authorization header.", "duplicate_authorization")
    key = bearer_token(headers[0] if headers else "")
    if key is None:
        raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.", "missing_api_key")
    # Keys are looked up by their SHA-256: a timing difference could only reveal digest prefixes,
    # never the key, and the final comparison is constant-time.
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    tenant = runtime.tenant_by_key_hash.get(digest)
    if tenant is None or not any(hmac.compare_digest(digest, h) for h in tenant.key_sha256):
        raise ApiError(401, "Invalid API key.", "invalid_api_key")
    return tenant


def _tier(request: web.Request, tenant: Tenant, runtime: Runtime) -> str:
    asked = request.headers.get("x-polymorph-tier")
    if asked is None:
        return tenant.default_tier
    if asked not in runtime.config.tiers:
        raise ApiError(400, f"Unknown tier {asked[:64]!r} in x-polymorph-tier; configured tiers: {', '.join(runtime.config.tiers)}.", "unknown_tier", "x-polymorph-tier")
    if asked not in tenant.tiers:
        raise ApiError(403, f"Tier {asked!r} is not allowed for this key (allowed: {', '.join(tenant.tiers)}).", "tier_not_allowed", "x-polymorph-tier")
    return asked


def _model_list(runtime: Runtime, tenant: Tenant) -> list[dict[str, object]]:
    """What ``GET /v1/models`` lists for ``tenant``: served models, its adapters, and the listed aliases."""
    data: list[dict[str, object]] = [
        {"id": model, "object": "model", "created": 0, "owned_by": "polymorph"}
        for model in runtime.served_models()
        if model not in runtime.adapter_base and tenant.may_use_model(model)
    ]
    data += listed_adapters(runtime.adapter_base, tenant)
    served = set(runtime.served_models())
    data += [
        {"id": public, "object": "model", "created": 0, "owned_by": "polymorph", "root": alias.model}
        for public, alias in runtime.config.aliases.items()
        if alias.listed and alias.model in served and (tenant.may_use_model(public) or tenant.may_use_model(alias.model))
    ]
    return data


async def _read_json(request: web.Request, max_body_bytes: int, timeout_s: float) -> tuple[bytes, object]:
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise ApiError(413, f"Request body of {length} bytes exceeds the limit of {max_body_bytes} bytes.", "request_too_large")
    try:
        if request.content.is_eof():  # the whole body came with the head (the usual case): nothing to wait for
            raw = await request.read()
        else:
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"Request body exceeds the limit of {max_body_bytes} bytes.", "request_too_large") from None
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout_s:g} s.", "request_timeout") from None
    except RequestPayloadError as exc:  # a Content-Encoding the body does not decode as, or a broken chunk (was a 500)
        raise unreadable_body(exc) from None
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object.", "invalid_json")
    try:
        return raw, orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}.", "invalid_json") from None


def _met_slo(runtime: Runtime, tier: str, outcome: Outcome) -> bool:
    """Did this request meet its tier's objectives? (A latency the gateway could not see counts as met.)"""
    if outcome.status != 200 or outcome.stream_error is not None:
        return False
    objectives = runtime.config.tiers.get(tier)
    if objectives is None:
        return True
    scale = runtime.time_scale(outcome.pool)  # objectives are in fleet time; emulated GPUs may run faster
    return objectives.met(None if outcome.ttft_s is None else outcome.ttft_s * scale, None if outcome.tpot_s is None else outcome.tpot_s * scale)


def _resolve_model(runtime: Runtime, tenant: Tenant, body: dict[str, object], model: str, raw: bytes) -> tuple[str | None, str, bytes]:
    """(the alias the client named or None, the served model, the body to send) of a request naming
    ``model``; raises 404 for a model no pool serves and 403 for one the tenant may not use (an adapter: the
    adapter and its base model must both be allowed). An adapter keeps its name: engines select it by it."""
    public = None
    alias = runtime.config.aliases.get(model) if runtime.config.aliases else None
    if alias is not None:  # resolved before anything else looks at the model; only aliased requests pay the re-encode
        public, model = model, alias.model
        body["model"] = model
        raw = orjson.dumps(body)
    if not any(pool.serves(model) for pool in runtime.pools):
        raise ApiError(404, f"The model {model[:200]!r} does not exist on this gateway.", "model_not_found", "model")
    base = runtime.adapter_base.get(model)
    if not (tenant.may_use_adapter(model, base) if base is not None else
            tenant.may_use_model(model) or (public is not None and tenant.may_use_model(public))):
        raise ApiError(403, f"This key may not use model {model[:200]!r}.", "model_not_allowed", "model")
    return public, model, raw


class Handlers:
    def __init__(self, state: GatewayState, tracer: RequestTracer | None = None) -> None:
        self.state = state
        self.tracer = tracer
        self.response_ids = ResponseIds()  # Responses ids this process proxied -> the replica holding each

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if request.method != "POST":
            return error_response(ApiError(405, f"Use POST for {request.path}.", "method_not_allowed", allow="POST"))
        state = self.state
        runtime = state.runtime
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        tenant_name, tier, model, outcome = _UNAUTHENTICATED, "-", "-", Outcome()
        public = None  # the alias the client named, when it named one
        shape = None
        limiter = None
        trace = self.tracer.start(request.method, request.path, request.headers) if self.tracer is not None else None
        try:
            tenant = _authenticate(request, runtime)
            tenant_name = tenant.name
            tier = _tier(request, tenant, runtime)
            server = runtime.config.server
            raw, body = await _read_json(request, server.max_body_bytes, server.body_read_timeout_s)
            model, stream, max_tokens = validate_body(body, chat)
            public, model, raw = _resolve_model(runtime, tenant, body, model, raw)  # type: ignore[arg-type]
            classify_span = trace.start_classify() if trace is not None else None
            shape = runtime.classifier.classify(body, chat=chat, tenant=tenant.name, tier=tier)  # type: ignore[arg-type]
            if trace is not None and classify_span is not None:
                trace.end_classify(classify_span, shape)
            # every choice generated counts: n completions (best_of candidates) of up to max_tokens each
            choices = max(body.get("n") or 1, body.get("best_of") or 1)
            limiter = await self._admit(runtime, tenant.name, tier, model, shape, shape.prompt_tokens + choices * (max_tokens or shape.predicted_output_p50))
            assert state.proxy is not None
            response = await state.proxy.forward(request, runtime, shape, model, raw, stream, outcome, body, trace=trace)  # type: ignore[arg-type]
        except Exception as err:  # an ApiError is its envelope; a bug costs one request a 500, never the process or a hang
            response = self._failed(err, outcome, tenant_name, shape)
        except asyncio.CancelledError:  # the client went away: counted as it got, and its span still ends
            self._client_left(runtime, tenant_name, tier, model, shape, outcome, loop.time() - started_at, public, CHAT_METER if chat else COMPLETIONS_METER, trace)
            raise
        finally:
            if limiter is not None:
                limiter.release()
        self._record(runtime, tenant_name, tier, model, shape, outcome, loop.time() - started_at, public, CHAT_METER if chat else COMPLETIONS_METER)
        if trace is not None:
            trace.finish(response.status, tenant_name, tier, model, shape, outcome)
        return response

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, EMBEDDINGS)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, RESPONSES)

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, RERANK)

    async def score(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, SCORE)

    async def _endpoint(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Embeddings, Responses, rerank and score: the chat path's steps, with the endpoint's own reading
        of the body, its own charge (input only for the pooling endpoints) and its own wire."""
        if request.method != "POST":
            return error_response(ApiError(405, f"Use POST for {request.path}.", "method_not_allowed", allow="POST"))
        state = self.state
        runtime = state.runtime
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        tenant_name, tier, model, outcome = _UNAUTHENTICATED, "-", "-", Outcome()
        public = None
        shape = None
        limiter = None
        trace = self.tracer.start(request.method, request.path, request.headers) if self.tracer is not None else None
        try:
            tenant = _authenticate(request, runtime)
            tenant_name = tenant.name
            tier = _tier(request, tenant, runtime)
            server = runtime.config.server
            raw, body = await _read_json(request, server.max_body_bytes, server.body_read_timeout_s)
            parsed = endpoint.parse(body)
            model = parsed.model
            public, model, raw = _resolve_model(runtime, tenant, body, model, raw)  # type: ignore[arg-type]
            classify_span = trace.start_classify() if trace is not None else None
            shape = runtime.classifier.classify(parsed.classify_body, chat=parsed.chat, tenant=tenant.name, tier=tier)
            if trace is not None and classify_span is not None:
                trace.end_classify(classify_span, shape)
            num_tokens = shape.prompt_tokens + ((parsed.max_output_tokens or shape.predicted_output_p50) if parsed.has_output else 0)
            limiter = await self._admit(runtime, tenant.name, tier, model, shape, num_tokens)
            pinned = None
            if parsed.previous_response_id is not None:  # after admission: a lookup asks the replicas, and is limited like the request
                pinned = await self._holder(runtime, parsed.previous_response_id, model, tenant.name)
            assert state.proxy is not None
            response = await state.proxy.forward(request, runtime, shape, model, raw, parsed.stream, outcome, body, endpoint.wire, pinned, trace)  # type: ignore[arg-type]
            if outcome.response_id is not None and parsed.store and outcome.status == 200 and outcome.stream_error is None:
                self.response_ids.remember(outcome.response_id, outcome.replica, tenant.name)
        except Exception as err:  # an ApiError is its envelope; a bug costs one request a 500, never the process or a hang
            response = self._failed(err, outcome, tenant_name, shape)
        except asyncio.CancelledError:  # the client went away: counted as it got, and its span still ends
            self._client_left(runtime, tenant_name, tier, model, shape, outcome, loop.time() - started_at, public, endpoint.meter, trace)
            raise
        finally:
            if limiter is not None:
                limiter.release()
        self._record(runtime, tenant_name, tier, model, shape, outcome, loop.time() - started_at, public, endpoint.meter)
        if trace is not None:
            trace.finish(response.status, tenant_name, tier, model, shape, outcome)
        return response

    async def _holder(self, runtime: Runtime, response_id: str, model: str, tenant: str) -> str:
        """The replica holding the stored response ``response_id`` (of ``model``): the one this process
        proxied it to, or the one of the model's replicas that answers for it; else 400, as for another
        tenant's response (before, any tenant could continue any conversation whose id it knew)."""
        hidden = self.response_ids.owned_by_another(response_id, tenant)
        pinned = None if hidden else self.response_ids.replica_of(response_id)
        if pinned is not None:
            return pinned
        now = asyncio.get_running_loop().time()
        candidates = [r for p in runtime.pools for r in p.replicas if p.serves(model) and r.serves(model) and r.routable(now)]
        assert self.state.session is not None
        found = None if hidden else await find_stored(self.state.session, candidates, response_id, runtime.config.upstream.connect_timeout_s)
        if found is None:
            raise ApiError(400, f"Previous response {response_id[:200]!r} was not found: no replica serving {model[:200]!r} holds it "
                           "(each engine stores its own responses; it may have been forgotten or restarted).",
                           "previous_response_not_found", "previous_response_id")
        self.response_ids.remember(response_id, found.replica.name, None)
        return found.replica.name

    async def retrieve_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{response_id}``: the stored response, from the replica that holds it."""
        runtime = self.state.runtime
        try:
            tenant = _authenticate(request, runtime)
            response_id = request.match_info["response_id"]
            now = asyncio.get_running_loop().time()
            known = runtime.replica_by_name.get(self.response_ids.replica_of(response_id) or "")
            candidates = [known] if known is not None else [r for p in runtime.pools for r in p.replicas if r.routable(now)]
            assert self.state.session is not None
            # another tenant's response is answered as one that does not exist (before, any key could read it)
            found = None if self.response_ids.owned_by_another(response_id, tenant.name) else await find_stored(
                self.state.session, candidates, response_id, runtime.config.upstream.connect_timeout_s)
            if found is None:
                raise ApiError(404, f"No replica holds a stored response {response_id[:200]!r}.", "response_not_found")
        except ApiError as err:
            return error_response(err)
        self.response_ids.remember(response_id, found.replica.name, None)
        return web.Response(body=found.body, content_type=_JSON, headers={"x-polymorph-pool": found.replica.pool, "x-polymorph-replica": found.replica.name})

    async def _admit(self, runtime: Runtime, tenant: str, tier: str, model: str, shape: Shape, num_tokens: int) -> Limiter:
        """A classified request counted (the controller's telemetry, the shape metric) and admitted by its
        tenant's limiter, which the caller releases when it ends; a refusal raises the 429."""
        state = self.state
        if state.live is not None:
            state.live.telemetry.record_arrival(state.live.now(), shape.name, tier, shape.prompt_tokens, model)
        state.metrics.child(state.metrics.shapes, shape.name, shape.domain).inc()
        limiter = runtime.limiters[tenant]
        if limiter.tenant.budget_monthly_usd is not None:  # before the limiter: a refusal takes no rate
            await runtime.spend.refresh(tenant)  # a limits store: what every gateway charged
            over_budget = budget_refusal(runtime.spend, limiter.tenant, time.time())
            if over_budget is not None:
                raise ApiError(429, over_budget.message, over_budget.code, retry_after_s=over_budget.retry_after_s)
        now = asyncio.get_running_loop().time()
        # a limits store (limits.store) answers over the network; the in-process and shared-memory limiters at once
        refusal = limiter.admit(num_tokens, now) if limiter.synchronous else await limiter.admit_async(num_tokens, now)
        if refusal is not None:
            raise ApiError(429, refusal.message, refusal.code, retry_after_s=refusal.retry_after_s)
        return limiter

    def _failed(self, err: Exception, outcome: Outcome, tenant_name: str, shape: Shape | None) -> web.Response:
        """The answer to a request that raised: an ``ApiError``'s envelope (counted as a rejection below 500),
        anything else a logged 500."""
        if isinstance(err, ApiError):
            outcome.status = err.status
            if err.status < 500:
                self.state.metrics.reject(tenant_name, err.code)
            return error_response(err, {"x-polymorph-shape": shape.name} if shape is not None else None)
        traceback.print_exc(file=sys.stderr)
        outcome.status = 500
        return error_response(ApiError(500, "Internal gateway error; it has been logged.", "internal_error"))

    def _client_left(self, runtime: Runtime, tenant: str, tier: str, model: str, shape: Shape | None, outcome: Outcome, duration_s: float,
                     alias: str | None, meter: Meter, trace: RequestTrace | None) -> None:
        """A request whose client went away (aiohttp cancels its handler): recorded with what it got, so a
        stream read to its end is counted whole; one that got no answer is a 499, nginx's client-closed."""
        if outcome.status == 0:
            outcome.status = CLIENT_CLOSED
        self._record(runtime, tenant, tier, model, shape, outcome, duration_s, alias, meter)
        if trace is not None:
            trace.finish(0, tenant, tier, model, shape, outcome)

    def _record(self, runtime: Runtime, tenant: str, tier: str, model: str, shape: Shape | None, outcome: Outcome, duration_s: float,
                alias: str | None, meter: Meter) -> None:
        metrics = self.state.metrics
        metrics.count_request(tenant, tier, outcome.pool, outcome.status)
        if outcome.pool != "-":
            e2e, ttft, tpot = metrics.latencies(tier, outcome.pool)
            e2e.observe(duration_s)
            if outcome.ttft_s is not None:
                ttft.observe(outcome.ttft_s)
            if outcome.tpot_s is not None:
                tpot.observe(outcome.tpot_s)
        if shape is not None:
            met_slo = _met_slo(runtime, tier, outcome)
            self.state.series.record(time.time(), shape.name, tier, outcome.pool, outcome.status == 200, met_slo, outcome.ttft_s, outcome.tpot_s)
            if self.state.live is not None:
                cached = (outcome.cached_tokens, outcome.prompt_tokens) if outcome.cached_tokens is not None and outcome.prompt_tokens else (0, 0)
                self.state.live.telemetry.record_outcome(self.state.live.now(), shape.name, outcome.pool, met_slo, outcome.completion_tokens or 0, model,
                                                         *cached)
                if outcome.replica != "-":
                    self.state.replica_outcomes.record(self.state.live.now(), outcome.replica, outcome.status == 200 and outcome.stream_error is None,
                                                       met_slo, outcome.ttft_s, outcome.tpot_s, outcome.completion_tokens or 0)
        if outcome.completion_tokens is not None:
            metrics.child(metrics.tokens, tenant, meter.output_kind).inc(outcome.completion_tokens)
            if shape is not None and outcome.status == 200 and meter.learns_output:
                runtime.classifier.observe(shape, outcome.completion_tokens)
        if outcome.prompt_tokens is not None:
            metrics.child(metrics.tokens, tenant, meter.input_kind).inc(outcome.prompt_tokens)
        cost_usd = self._charge(runtime, tenant, outcome)
        log = self.state.access_log
        if log is not None:
            log.write(
                {
                    "ts": round(time.time(), 3),
                    "endpoint": meter.name,
                    "tenant": tenant,
                    "tier": tier,
                    "model": model[:200],
                    "alias": alias,
                    "shape": getattr(shape, "name", None),
                    "domain": getattr(shape, "domain", None),
                    "pool": outcome.pool,
                    "replica": outcome.replica,
                    "status": outcome.status,
                    "attempts": outcome.attempts,
                    "ttft_ms": round(outcome.ttft_s * 1000, 2) if outcome.ttft_s is not None else None,
                    "duration_ms": round(duration_s * 1000, 2),
                    "prompt_tokens": outcome.prompt_tokens,
                    "completion_tokens": outcome.completion_tokens,
                    "stream_error": outcome.stream_error,
                    "cost_usd": round(cost_usd, 9),
                }
            )

    def _charge(self, runtime: Runtime, tenant: str, outcome: Outcome) -> float:
        """The request's cost, counted for its tenant and pool and added to the tenant's spend this period."""
        cost_usd = request_cost_usd(runtime, outcome.pool, outcome.engine_share_s)
        if cost_usd <= 0.0 or tenant == _UNAUTHENTICATED:
            return cost_usd
        metrics = self.state.metrics
        metrics.child(metrics.tenant_cost, tenant, outcome.pool).inc(cost_usd)
        runtime.spend.add(tenant, cost_usd)
        limiter = runtime.limiters.get(tenant)
        budget = limiter.tenant.budget_monthly_usd if limiter is not None else None
        if budget is not None:
            metrics.child(metrics.budget_remaining, tenant).set(max(0.0, budget - runtime.spend.spent_usd(tenant)))
        return cost_usd

    async def models(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return error_response(ApiError(405, "Use GET for /v1/models.", "method_not_allowed", allow="GET, HEAD"))
        runtime = self.state.runtime
        try:
            tenant = _authenticate(request, runtime)
        except ApiError as err:
            return error_response(err)
        return web.Response(body=orjson.dumps({"object": "list", "data": _model_list(runtime, tenant)}), content_type=_JSON)

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: one entry of the list (the SDK's ``models.retrieve``); 404 for a model the
        key may not use or that no pool serves, as OpenAI answers (before, 404 ``unknown_endpoint``)."""
        runtime = self.state.runtime
        try:
            tenant = _authenticate(request, runtime)
            wanted = request.match_info["model"]
            found = next((entry for entry in _model_list(runtime, tenant) if entry["id"] == wanted), None)
            if found is None:
                raise ApiError(404, f"The model {wanted[:200]!r} does not exist.", "model_not_found", "model")
        except ApiError as err:
            return error_response(err)
        return web.Response(body=orjson.dumps(found), content_type=_JSON)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    async def readyz(self, request: web.Request) -> web.Response:
        now = asyncio.get_running_loop().time()
        ready = any(r.routable(now) for p in self.state.runtime.pools for r in p.replicas)
        if ready:
            return web.Response(body=b'{"status":"ready"}', content_type=_JSON)
        return error_response(ApiError(503, "No replica is healthy yet.", "not_ready", retry_after_s=1.0))

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=DOCUMENT_BYTES, content_type=_JSON)

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(ApiError(404, f"No such endpoint: {request.method} {request.path[:200]}.", "unknown_endpoint"))


async def _on_startup(app: web.Application) -> None:
    state = app[STATE_KEY]
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60, enable_cleanup_closed=True)
    state.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, json_serialize=lambda o: orjson.dumps(o).decode())
    state.upstream_pool = UpstreamPool()
    state.proxy = Proxy(state.upstream_pool, state.metrics)
    state.proxy.waits.attach(state.runtime, loop.time())
    await app[PROBER_KEY].discover_models()  # the replicas' models (for /v1/models, routing) before the first request
    app[PROBER_KEY].start()
    app[ENGINE_SCRAPER_KEY].start()
    if state.access_log is not None:
        state.access_log.start()
    if state.live is not None:
        state.live.start_loop()


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    if state.live is not None:
        await state.live.stop_loop()
    await app[PROBER_KEY].stop()
    await app[ENGINE_SCRAPER_KEY].stop()
    if state.access_log is not None:
        await state.access_log.stop()
    if state.session is not None:
        await state.session.close()
    if state.upstream_pool is not None:
        state.upstream_pool.close()


def build_app(
    config: GatewayConfig,
    replica_urls: dict[str, list[str]] | None = None,
    live_fleet: Callable[[GatewayState], FleetLink] | None = None,
    span_exporter: SpanExporter | None = None,
) -> web.Application:
    """The gateway as an aiohttp app. Raises ClassifierLoadError early if the classifier cannot load.

    ``live_fleet`` builds the control loop over the replicas an actuator started (fleet.controller);
    ``span_exporter`` replaces the OTLP exporter when ``tracing`` is enabled (tests: in memory)."""
    state = GatewayState(config, replica_urls or {})
    if live_fleet is not None:
        state.live = live_fleet(state)
    app = web.Application(client_max_size=config.server.max_body_bytes)
    app[STATE_KEY] = state
    tracer = build_tracer(config.tracing, span_exporter)
    h = Handlers(state, tracer)
    app[PROBER_KEY] = HealthProber(state)
    app[ENGINE_SCRAPER_KEY] = EngineScraper(state, config.upstream.engine_metrics_interval_s)
    admin = AdminHandlers(state, app[ENGINE_SCRAPER_KEY])
    router = app.router
    router.add_route("*", "/v1/chat/completions", h.chat_completions)
    router.add_route("*", "/v1/completions", h.completions)
    router.add_route("*", "/v1/models", h.models)
    router.add_get(r"/v1/models/{model:[\s\S]+}", h.retrieve_model)  # any character: an adapter's name may hold a "/"
    router.add_route("*", "/v1/embeddings", h.embeddings)
    router.add_route("*", "/v1/responses", h.responses)
    router.add_get("/v1/responses/{response_id}", h.retrieve_response)
    for path in RERANK_PATHS:
        router.add_route("*", path, h.rerank)
    for path in SCORE_PATHS:
        router.add_route("*", path, h.score)
    router.add_get("/healthz", h.healthz)
    router.add_get("/readyz", h.readyz)
    router.add_get("/metrics", h.metrics_endpoint)
    router.add_get("/admin/state", admin.admin_state)
    router.add_get("/admin/decisions", admin.admin_decisions)
    router.add_route("*", "/admin/move", admin.admin_move)
    router.add_route("*", "/admin/canary", admin.admin_canary)
    router.add_get("/openapi.json", h.openapi)
    add_dashboard_routes(
        app,
        lambda: state.series,
        lambda request: is_admin_request(request, state.runtime.config.server.admin_token_sha256),
        lambda: state.runtime.config.server.admin_token_sha256,
    )
    router.add_route("*", r"/{tail:[\s\S]*}", h.not_found)  # [\s\S], not ".": a path with a newline gets the JSON 404 too
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    if tracer is not None:
        app.on_cleanup.append(lambda _: tracer.shutdown())
    return app
