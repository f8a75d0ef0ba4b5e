"""A stand-in deployment for the dashboard's browser test: the real dashboard routes and a real Series,
with ``/admin/state`` and ``/admin/decisions`` answered from a scripted drift (until the gateway
serves its decision log, when the test switches to a real gateway).

The last hour is pre-filled with a drift from short chats to long prompts 25 minutes ago, the
controller's drift/plan/step/verify/recompile decisions after it, and live traffic keeps playing
(a few requests a second, stamped with the wall clock). Run it by hand to look at the page:
``python -m tests.gateway.dashboard_fixture --port 8099 --token some-admin-token``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from gateway.dashboard import add_dashboard_routes, is_admin_request
from gateway.errors import ApiError, error_response
from gateway.series import Series

DRIFT_AGO_S = 1500
TIER_OF_SHAPE = {"short-chat": "interactive", "reasoning": "interactive", "long-context": "standard", "batch": "batch"}
POOL_OF_SHAPE = {"short-chat": "chat-h100", "batch": "chat-h100", "long-context": "long-h200", "reasoning": "long-h200"}
OBJECTIVES = {"interactive": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.05}, "standard": {"ttft_p99_s": 3.0, "tpot_p99_s": 0.1}, "batch": {"ttft_p99_s": 60.0, "tpot_p99_s": 0.5}}
MIX_BEFORE = {"short-chat": 6.0, "long-context": 1.0, "reasoning": 1.5, "batch": 0.8}
MIX_AFTER = {"short-chat": 3.0, "long-context": 4.5, "reasoning": 1.5, "batch": 0.8}


def _rates(seconds_ago: float) -> dict[str, float]:
    """Requests/s per shape: a ramp over 3 minutes from the old mix to the new one."""
    progress = min(1.0, max(0.0, (DRIFT_AGO_S - seconds_ago) / 180))
    return {shape: MIX_BEFORE[shape] + (MIX_AFTER[shape] - MIX_BEFORE[shape]) * progress for shape in MIX_BEFORE}


def _strain(seconds_ago: float) -> float:
    """How overloaded the long-prompt pool is: from the drift until the repartition settles."""
    if DRIFT_AGO_S >= seconds_ago > 1300:
        return min(1.0, (DRIFT_AGO_S - seconds_ago) / 120)
    if 1300 >= seconds_ago > 1180:
        return (seconds_ago - 1180) / 120
    return 0.0


def _record(series: Series, rng: random.Random, at: float, shape: str, strain: float) -> None:
    tier = TIER_OF_SHAPE[shape]
    base_ttft = {"interactive": 0.18, "standard": 0.7, "batch": 4.0}[tier]
    pressure = 1.0 + strain * (4.0 if shape == "long-context" else 1.5)
    ttft = base_ttft * pressure * math.exp(rng.gauss(0.0, 0.35))
    tpot = {"interactive": 0.018, "standard": 0.03, "batch": 0.06}[tier] * (1 + strain) * math.exp(rng.gauss(0.0, 0.2))
    ok = rng.random() > 0.002
    objectives = OBJECTIVES[tier]
    met = ok and ttft <= objectives["ttft_p99_s"] and tpot <= objectives["tpot_p99_s"]
    series.record(at, shape, tier, POOL_OF_SHAPE[shape], ok, met, ttft, tpot)


def fill_history(series: Series, now_unix_s: float, seed: int) -> None:
    rng = random.Random(seed)
    at = now_unix_s - series.span_s
    while at < now_unix_s:
        ago = now_unix_s - at
        rates = _rates(ago)
        total = sum(rates.values())
        shape = rng.choices(list(rates), weights=list(rates.values()))[0]
        _record(series, rng, at, shape, _strain(ago))
        at += rng.expovariate(total)


def decisions(now_unix_s: float) -> list[dict[str, Any]]:
    drift_at = now_unix_s - DRIFT_AGO_S
    entries = [
        (drift_at + 40, "drift", "Traffic mix drifted: long-context 11% → 46% of requests", {"mix_before": {k: round(v / 9.3, 3) for k, v in MIX_BEFORE.items()}, "mix_after": {k: round(v / 9.8, 3) for k, v in MIX_AFTER.items()}, "distance": 0.37, "threshold": 0.15, "window_s": 300}),
        (drift_at + 70, "plan", "Move 1 H100 slot from chat-h100 to long-h200 (+0.21 predicted goodput)", {"predicted_goodput_before": 0.71, "predicted_goodput_after": 0.92, "moves": [["h100-2", "chat-h100", "long-h200"]], "config": {"tp": 1, "chunked_prefill_size": 8192, "max_running_requests": 64}}),
        (drift_at + 110, "step", "Drained h100-2 from chat-h100", {"slot": "h100-2", "pool": "chat-h100", "drain_s": 38.2}),
        (drift_at + 200, "step", "h100-2 healthy in long-h200 with the long-prompt configuration", {"slot": "h100-2", "pool": "long-h200", "start_s": 61.5}),
        (drift_at + 320, "verify", "Goodput 0.90 observed vs 0.92 predicted: kept", {"predicted_goodput": 0.92, "observed_goodput": 0.9, "tolerance": 0.05}),
        (now_unix_s - 600, "recompile", "long-h200 recompiled: chunked_prefill_size 8192 → 16384", {"pool": "long-h200", "before": {"chunked_prefill_size": 8192, "max_running_requests": 64}, "after": {"chunked_prefill_size": 16384, "max_running_requests": 48}, "predicted_gain": 0.04}),
    ]
    return [{"at_unix_s": round(at, 3), "kind": kind, "summary": summary, "evidence": evidence} for at, kind, summary, evidence in entries]


def fleet_state(now_unix_s: float, started_at_unix_s: float, series: Series) -> dict[str, Any]:
    wobble = 0.5 + 0.5 * math.sin(now_unix_s / 7)
    attainment = series.slo_attainment(now_unix_s, 300)

    def replica(name: str, port: int, in_flight: int, health: str = "healthy", available: bool = True, draining: bool = False) -> dict[str, Any]:
        return {"name": name, "url": f"http://127.0.0.1:{port}", "health": health, "available": available, "draining": draining, "in_flight": in_flight, "outstanding_tokens": in_flight * 900, "ejections": 0, "models": ["llama-3.1-8b"]}

    pools = [
        {
            "name": "chat-h100", "models": ["llama-3.1-8b"], "gpu": "H100-SXM", "shapes": ["batch", "short-chat"],
            "engine": {"tp": 1, "max_running_requests": 256, "chunked_prefill_size": 2048, "schedule_policy": "lpm"},
            "in_flight": 14 + int(6 * wobble), "load_fraction": round(0.42 + 0.1 * wobble, 3), "slo_attainment": attainment.get("chat-h100"),
            "replicas": [replica("chat-h100-0", 9101, 8), replica("chat-h100-1", 9102, 7), replica("chat-h100-2", 9103, 2, draining=True)],
        },
        {
            "name": "long-h200", "models": ["llama-3.1-8b"], "gpu": "H200", "shapes": ["long-context", "reasoning"],
            "engine": {"tp": 1, "max_running_requests": 48, "chunked_prefill_size": 16384, "schedule_policy": "fcfs"},
            "in_flight": 30 + int(8 * wobble), "load_fraction": round(0.71 + 0.08 * wobble, 3), "slo_attainment": attainment.get("long-h200"),
            "replicas": [replica("long-h200-0", 9201, 16), replica("long-h200-1", 9202, 15), replica("long-h200-2", 9203, 0, health="probing", available=False)],
        },
    ]
    return {
        "config": {"version": 4, "source": "config.example.yaml"},
        "uptime_s": round(now_unix_s - started_at_unix_s, 1),
        "tenants": [{"name": "demo", "tiers": list(OBJECTIVES), "in_flight": 40}],
        "shapes": ["short-chat", "long-context", "reasoning", "batch"],
        "tiers": OBJECTIVES,
        "pools": pools,
    }


def build_fixture_app(admin_token: str, seed: int = 7, live_rps: float = 8.0) -> web.Application:
    admin_sha = hashlib.sha256(admin_token.encode()).hexdigest()
    started_at = time.time()
    series = Series()
    fill_history(series, started_at, seed)
    app = web.Application()

    def check_admin(request: web.Request) -> bool:
        return is_admin_request(request, admin_sha)

    def refused() -> web.Response:
        return error_response(ApiError(401, "The admin API needs 'Authorization: Bearer <admin token>'.", "invalid_admin_token"))

    async def admin_state(request: web.Request) -> web.Response:
        if not check_admin(request):
            return refused()
        return web.json_response(fleet_state(time.time(), started_at - 3 * 3600, series), dumps=lambda o: orjson.dumps(o).decode())

    async def admin_decisions(request: web.Request) -> web.Response:
        if not check_admin(request):
            return refused()
        return web.json_response({"decisions": decisions(started_at)})

    async def play_traffic(app: web.Application) -> AsyncIterator[None]:
        async def play() -> None:
            rng = random.Random(seed + 1)
            while True:
                await asyncio.sleep(rng.expovariate(live_rps))
                shape = rng.choices(list(MIX_AFTER), weights=list(MIX_AFTER.values()))[0]
                _record(series, rng, time.time(), shape, 0.0)

        task = asyncio.create_task(play())
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    add_dashboard_routes(app, lambda: series, check_admin, lambda: admin_sha)
    app.router.add_get("/admin/state", admin_state)
    app.router.add_get("/admin/decisions", admin_decisions)
    app.router.add_get("/healthz", healthz)
    app.cleanup_ctx.append(play_traffic)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the dashboard over a scripted drift (test fixture).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True, help="the admin token the page will accept")
    args = parser.parse_args()
    web.run_app(build_fixture_app(args.token), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
