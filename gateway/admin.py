"""The admin API: fleet state and the decision log, behind the admin token or a dashboard session."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from fleet.decisions import read_decision
from fleet.evidence import PlanEvidence, VerifyEvidence
from fleet.operator import MoveRefused
from fleet.pool import ReplicaState
from gateway.budgets import TenantSpend, tenant_spend
from gateway.dashboard import is_admin_request
from gateway.engine_scrape import EngineScraper
from gateway.errors import ApiError, error_response, unreadable_body
from gateway.state import GatewayState

_JSON = "application/json"


def _summary(entry: dict[str, object]) -> str:
    """A one-line reading of a decision-log entry for people (the evidence holds the details)."""
    found = read_decision(entry)
    if found is None:  # a line this version does not read (hand-written, or of a kind it does not know)
        return str(entry.get("kind", "decision"))
    text = found.kind
    if found.moves:
        text += f": {len(found.moves)} replica move(s)"
    evidence = found.evidence
    if isinstance(evidence, PlanEvidence):
        detail: str | None = evidence.outcome
    elif isinstance(evidence, VerifyEvidence):
        detail = "kept" if evidence.ok else "worse than predicted"
    else:
        detail = evidence.reason
    if detail:
        text += f" ({detail})"
    return text


def _engine(replica: ReplicaState, engines: EngineScraper | None, now: float) -> dict[str, object]:
    """The replica's engine figures as the router reads them, or why there are none (it is then
    routed by the gateway's own counts)."""
    load = replica.engine
    error = engines.error_of(replica) if engines is not None else "engine metrics are not read by this gateway"
    if load is None:
        return {"engine": None, "engine_error": error}
    record = {
        "age_s": round(now - load.scraped_at, 3),
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "foreign_requests": replica.foreign_requests,
        "kv_usage_fraction": load.kv_usage_fraction,
        "prefix_cache_hit_fraction": engines.hit_fraction_of(replica) if engines is not None else None,
        "prefix_cache_queries_tokens": load.prefix_cache_queries_tokens,
        "prefix_cache_hits_tokens": load.prefix_cache_hits_tokens,
        "prompt_tokens_total": load.prompt_tokens_total,
        "generation_tokens_total": load.generation_tokens_total,
    }
    return {"engine": record, "engine_error": error}  # an error here: the last read failed, the figures before it still stand


def _spend(spend: TenantSpend) -> dict[str, object]:
    remaining = spend.remaining_usd
    return {"period": spend.period, "spent_usd": round(spend.spent_usd, 6), "budget_usd": spend.budget_usd,
            "remaining_usd": None if remaining is None else round(remaining, 6)}


class AdminHandlers:
    def __init__(self, state: GatewayState, engines: EngineScraper | None = None) -> None:
        self.state = state
        self.engines = engines

    def _check_admin(self, request: web.Request) -> None:
        expected = self.state.runtime.config.server.admin_token_sha256
        if expected is None:
            raise ApiError(403, "The admin API is disabled: set server.admin_token in the config.", "admin_disabled")
        if not is_admin_request(request, expected):
            raise ApiError(401, "The admin API needs 'Authorization: Bearer <admin token>' or a dashboard session.", "invalid_admin_token")

    async def admin_state(self, request: web.Request) -> web.Response:
        try:
            self._check_admin(request)
        except ApiError as err:
            return error_response(err)
        runtime = self.state.runtime
        for tenant in runtime.config.tenants:  # with a limits store, what every gateway charged
            await runtime.spend.refresh(tenant.name)
        now = asyncio.get_running_loop().time()
        engine_by_pool = {spec.name: dict(spec.engine) for spec in runtime.config.pools}
        # what each pool's launched replicas all run now (an adopted canary's or a recompile's configuration)
        running = getattr(self.state.live, "running_configs_json", None)  # the embedded loop's launched replicas
        running_by_pool = {pool: orjson.loads(text) for pool, text in running().items()} if running is not None else {}
        attainment = self.state.series.slo_attainment(time.time(), 300.0)
        pools = [
            {
                "name": pool.name,
                "models": sorted(pool.models) if pool.models is not None else None,
                "gpu": pool.gpu,
                "engine": engine_by_pool.get(pool.name, {}),
                "running_engine": running_by_pool.get(pool.name),
                "shapes": sorted(pool.shapes),
                "in_flight": pool.num_in_flight,
                "load_fraction": round(min(pool.load_fraction(now), 1e9), 4),
                # the capacity model's view the router scores with (0: no plan has sized this pool)
                "max_running_per_replica": pool.max_running_per_replica,
                "rate_per_replica_rps": round(pool.rate_per_replica_rps, 3),
                "cost_per_hour": round(pool.cost_per_hour, 3),
                "slo_attainment": attainment.get(pool.name),
                "replicas": [
                    {
                        "name": r.name,
                        "url": r.url,
                        "health": r.breaker.state.value,
                        "available": r.breaker.available(now),
                        "draining": r.draining,
                        "in_flight": r.num_in_flight,
                        "outstanding_tokens": r.outstanding_tokens,
                        "failures": r.breaker.failures(now),  # the current run's; eject_after_failures ejects
                        "ejections": r.breaker.num_ejections,
                        "models": sorted(r.models) if r.models is not None else None,
                        "engine_kind": pool.engine_kind,
                        **_engine(r, self.engines, now),
                        "process": self.state.live.replica_process(r.name) if self.state.live is not None else None,
                    }
                    for r in pool.replicas
                ],
            }
            for pool in runtime.pools
        ]
        body = {
            "config": {"version": runtime.version, "source": runtime.config.source},
            "uptime_s": round(time.time() - self.state.started_at, 1),
            "tenants": [
                {"name": t.name, "tiers": list(t.tiers), "in_flight": runtime.limiters[t.name].num_in_flight,
                 "spend": _spend(tenant_spend(runtime.spend, t))}
                for t in runtime.config.tenants
            ],
            "shapes": list(runtime.config.shapes.names),
            "tiers": {name: {"ttft_p99_s": t.ttft_p99_s, "tpot_p99_s": t.tpot_p99_s} for name, t in runtime.config.tiers.items()},
            "pools": pools,
        }
        return web.Response(body=orjson.dumps(body), content_type=_JSON)

    async def admin_move(self, request: web.Request) -> web.Response:
        """``POST /admin/move`` ``{"replica": NAME, "to_pool": POOL}``: drain, restart with the pool's
        configuration on the same devices, verify, roll back if it never becomes healthy (202: begun;
        follow it in ``/admin/decisions`` and ``/admin/state``)."""
        try:
            self._check_admin(request)
            body = await _posted_object(request, "{\"replica\": NAME, \"to_pool\": POOL}", frozenset({"replica", "to_pool"}))
            for key in ("replica", "to_pool"):
                if not isinstance(body.get(key), str) or not body[key]:
                    raise ApiError(400, f"{key!r} must be a non-empty string.", "invalid_value", key)
            mover = getattr(self.state.live, "request_move", None)
            if mover is None:
                raise ApiError(409, "This gateway launches no replicas (replicas: {launch: N}), so it has none to move.", "no_launched_replicas")
            try:
                decisions = mover(body["replica"], body["to_pool"])
            except MoveRefused as exc:
                raise ApiError(exc.status, str(exc), "move_refused") from None
        except ApiError as err:
            return error_response(err)
        offset = self.state.decisions.clock_offset_s
        return web.Response(status=202, body=orjson.dumps({"move": {"replica": body["replica"], "to_pool": body["to_pool"]},
                                                           "decisions": [d.to_json(offset) for d in decisions]}), content_type=_JSON)

    async def admin_canary(self, request: web.Request) -> web.Response:
        """``POST /admin/canary`` ``{"pool": POOL, "config": {KNOB: VALUE, ...}}``: one replica of the pool restarts with
        the pool's engine configuration changed so, serves beside its siblings, and is adopted (the siblings follow)
        or rolled back by the canary judge (fleet.canary; 202: begun; the verdict is a ``canary`` decision)."""
        try:
            self._check_admin(request)
            body = await _posted_object(request, "{\"pool\": POOL, \"config\": {...}}", frozenset({"pool", "config"}))
            if not isinstance(body.get("pool"), str) or not body["pool"]:
                raise ApiError(400, "'pool' must be a non-empty string.", "invalid_value", "pool")
            config = body.get("config")
            if not isinstance(config, dict) or not config:
                raise ApiError(400, "'config' must be a non-empty object of engine configuration fields.", "invalid_value", "config")
            trial = getattr(self.state.live, "request_canary", None)
            if trial is None:
                raise ApiError(409, "This gateway launches no replicas (replicas: {launch: N}), so it has none to trial.", "no_launched_replicas")
            try:
                decisions = trial(body["pool"], config)
            except MoveRefused as exc:
                raise ApiError(exc.status, str(exc), "canary_refused", "config" if exc.status == 400 else None) from None
        except ApiError as err:
            return error_response(err)
        offset = self.state.decisions.clock_offset_s
        return web.Response(status=202, body=orjson.dumps({"canary": {"pool": body["pool"], "config": config},
                                                           "decisions": [d.to_json(offset) for d in decisions]}), content_type=_JSON)

    async def admin_decisions(self, request: web.Request) -> web.Response:
        try:
            self._check_admin(request)
            limit = int(request.query.get("limit", "200"))
            if not 1 <= limit <= 10_000:
                raise ValueError
        except ApiError as err:
            return error_response(err)
        except ValueError:
            return error_response(ApiError(400, "limit must be an integer from 1 to 10000.", "invalid_limit", "limit"))
        entries = [{**entry, "summary": _summary(entry)} for entry in self.state.decisions.tail(limit)]
        return web.Response(body=orjson.dumps({"decisions": entries, "log": self.state.decisions.health()}), content_type=_JSON)


async def _posted_object(request: web.Request, shape: str, fields: frozenset[str]) -> dict[str, Any]:
    """The JSON object an admin action was POSTed with (``shape`` tells a wrong method how to call it).
    A field other than ``fields`` is refused: these calls restart replicas, and a ``"dry_run": true``
    that was silently ignored would do what it meant to prevent."""
    if request.method != "POST":
        raise ApiError(405, f"Use POST with {shape}.", "method_not_allowed", allow="POST")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ApiError(400, "The body must be a JSON object.", "invalid_json") from None
    except RequestPayloadError as exc:  # a Content-Encoding the body does not decode as (was a 500)
        raise unreadable_body(exc) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", "invalid_json")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"Unknown field {unknown[0]!r}: the body is {shape}.", "unknown_field", unknown[0])
    return body
