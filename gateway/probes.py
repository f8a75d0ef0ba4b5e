"""Active health probes and model discovery: the gateway's only periodic I/O towards replicas.

A replica that answers ``GET /health`` is probed every ``health_interval_s``; a failure counts like a
failed request, and an ejected replica comes back only after its cool-down and a good probe (or a
good trial request). Replicas of ``--upstream`` pools report their models at ``GET /v1/models``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

import aiohttp
import orjson

from fleet.pool import ReplicaState
from gateway.background import BackgroundTask

if TYPE_CHECKING:
    from gateway.state import GatewayState


class HealthProber:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.task = BackgroundTask(self.run)

    def _timeout(self) -> aiohttp.ClientTimeout:
        settings = self.state.runtime.config.upstream
        return aiohttp.ClientTimeout(total=max(1.0, settings.connect_timeout_s * 2), sock_connect=settings.connect_timeout_s)

    def _replicas(self) -> list[ReplicaState]:
        return [r for pool in self.state.runtime.pools for r in pool.replicas]

    async def discover_models(self) -> None:
        """Ask every replica whose models are unknown what it serves (at start, then on each round)."""
        pending = [r for r in self._replicas() if r.models is not None and not r.models]
        if pending:
            await asyncio.gather(*(self._discover(r) for r in pending))

    async def _discover(self, replica: ReplicaState) -> None:
        assert self.state.session is not None
        try:
            async with self.state.session.get(replica.url + "/v1/models", timeout=self._timeout()) as resp:
                if resp.status != 200:
                    return
                payload = orjson.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            return
        data = payload.get("data") if isinstance(payload, dict) else None
        if isinstance(data, list):
            ids = {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
            if ids:
                replica.models = frozenset(ids)

    async def _probe(self, replica: ReplicaState) -> None:
        assert self.state.session is not None and self.state.proxy is not None
        loop = asyncio.get_running_loop()
        breaker = replica.breaker
        if not replica.offers_health or not breaker.available(loop.time()):
            return
        trial = breaker.on_dispatch()
        try:
            async with self.state.session.get(replica.url + "/health", timeout=self._timeout()) as resp:
                status = resp.status
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            status = 0
        except BaseException:
            breaker.on_undecided(trial)  # cancelled, or an error the round reports: the next round's probe decides
            raise
        if status == 404:
            replica.offers_health = False
            breaker.on_undecided(trial)  # no probe to decide: the next trial request will
            return
        if status == 200:
            self.state.proxy.mark_probe_success(replica, trial)
        else:
            self.state.proxy.mark_failure(replica)

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(self.state.runtime.config.upstream.health_interval_s)
                await self.discover_models()
                await asyncio.gather(*(self._probe(r) for r in self._replicas()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # probing must never stop for good
                print(f"polymorph: health probe round failed: {exc!r}", file=sys.stderr)

    def start(self) -> None:
        self.task.start()

    async def stop(self) -> None:
        await self.task.stop()
