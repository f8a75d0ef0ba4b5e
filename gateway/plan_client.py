"""A gateway process beside an out-of-process controller (``fleet.controller.mode: external``).

Every ``report_s`` fleet seconds it polls the controller's ``GET /plan`` (an ETag makes an unchanged
plan a 304) and applies a new one to its pools: replicas keep their load counters and circuit
breakers across plans, a replica the plan marks draining gets no new request, one the plan drops
leaves its pool. Then it posts ``POST /report``: the telemetry it aggregated since the last report
(``fleet.telemetry_batch``), its requests in flight per replica URL, and the plan version it now
routes on, which is what lets the controller stop a drained replica only once every gateway has
stopped sending it work. The plan's draining and starting replicas are the restarts a model's requests
are held for while none of its replicas is routable (gateway.restart_waits), as in embedded mode. When
the controller cannot be reached the gateway keeps routing on the last plan it applied and says so
once, not at every poll.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from typing import Any

import aiohttp
import orjson

from fleet.restart_hold import Restart
from fleet.telemetry_batch import TelemetryBatch
from gateway.background import BackgroundTask
from gateway.config import ControllerSettingsFile
from gateway.live_fleet import new_pool, new_replica, swap_pools
from gateway.replicas import made_pool_engine
from gateway.state import GatewayState

_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


def apply_plan(state: GatewayState, doc: dict[str, Any]) -> None:
    """Route on ``doc`` (the controller's plan): its pools and replicas, beside the config's static URLs."""
    runtime = state.runtime
    static = {spec.name: set(spec.urls) for spec in runtime.config.pools}
    planned = {p["name"]: p for p in doc["pools"]}
    current = {p.name: p for p in runtime.pools}
    old = {(r.pool, r.url): r for p in runtime.pools for r in p.replicas}
    pools = []
    for name in [*current, *(n for n in planned if n not in current)]:
        entry = planned.get(name)
        pool = current.get(name)
        if pool is None:
            assert entry is not None
            pool = new_pool(name, entry["model"], entry["gpu"], entry["config_json"], made_pool_engine(runtime.config, name, entry["gpu"]))
        replicas = [r for r in pool.replicas if r.url in static.get(name, ())]
        for item in entry["replicas"] if entry is not None else ():
            replica = old.get((name, item["url"])) or new_replica(state, item["name"], item["url"], name)
            replica.draining = bool(item["draining"])
            replicas.append(replica)
        if not replicas and name not in static:
            continue  # a pool the controller made and has emptied
        pool.replicas[:] = replicas
        pools.append(pool)
    swap_pools(state, tuple(pools))


def plan_restarts(doc: dict[str, Any]) -> list[Restart]:
    """The plan's replicas out of service for a move that brings them back (fleet.restart_hold): the
    draining ones, in the pool they leave, and the starting ones, in the pool they start in."""
    draining = [Restart(r["name"], p["name"], p["model"]) for p in doc["pools"] for r in p["replicas"] if r["draining"]]
    return draining + [Restart(s["name"], s["pool"], s["model"]) for s in doc.get("starting", ())]


class PlanClient:
    """What ``GatewayState.live`` is in external mode: telemetry out, plans in."""

    owns_pools = True

    def __init__(self, state: GatewayState, settings: ControllerSettingsFile, speed: float) -> None:
        assert settings.url is not None
        self.state = state
        self.url = settings.url
        self.speed = speed
        self.interval_s = max(0.05, settings.report_s / speed)
        self.telemetry = TelemetryBatch()
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}"
        self.epoch: str | None = None
        self.version = 0
        self._etag: str | None = None
        self._unreachable = False
        self._restarts: list[Restart] = []
        self.task = BackgroundTask(self._run)

    def now(self) -> float:
        """Fleet time, shared with the controller's process: Unix time x the emulator speed."""
        return time.time() * self.speed

    def replica_process(self, name: str) -> dict[str, object] | None:
        return None  # the external controller runs the processes (its state file lists them)

    def start_loop(self) -> None:
        if self.state.proxy is not None:
            self.state.proxy.holds.connect(lambda: self._restarts, lambda: self.state.runtime.pools)
        self.task.start()

    async def stop_loop(self) -> None:
        await self.task.stop()

    async def _run(self) -> None:
        while True:
            try:
                await self.exchange()
                if self._unreachable:
                    print(f"polymorph: the controller at {self.url} answers again (plan version {self.version})", file=sys.stderr, flush=True)
                self._unreachable = False
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                if not self._unreachable:
                    print(f"polymorph: the controller at {self.url} is unreachable ({type(exc).__name__}: {exc}); routing on plan version "
                          f"{self.version} until it answers", file=sys.stderr, flush=True)
                self._unreachable = True
            await asyncio.sleep(self.interval_s)

    async def exchange(self) -> None:
        """One poll of the plan, then one report (so the report acknowledges the plan just applied)."""
        session = self.state.session
        assert session is not None
        headers = {"If-None-Match": self._etag} if self._etag else {}
        async with session.get(self.url + "/plan", headers=headers, timeout=_TIMEOUT) as resp:
            if resp.status == 200:
                doc = orjson.loads(await resp.read())
                apply_plan(self.state, doc)
                self._restarts = plan_restarts(doc)
                self.epoch, self.version, self._etag = str(doc["epoch"]), int(doc["version"]), resp.headers.get("ETag")
                if self.state.proxy is not None:  # a replica routed again takes the requests held for it
                    self.state.proxy.holds.wake(asyncio.get_running_loop().time())
            elif resp.status != 304:
                raise ValueError(f"GET /plan answered {resp.status}")
        in_flight = {r.url: r.num_in_flight for p in self.state.runtime.pools for r in p.replicas if r.num_in_flight}
        report = {"gateway": self.gateway_id, "epoch": self.epoch, "version": self.version, "in_flight": in_flight,
                  "telemetry": self.telemetry.take()}
        async with session.post(self.url + "/report", data=orjson.dumps(report), timeout=_TIMEOUT,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 204:
                raise ValueError(f"POST /report answered {resp.status}")
