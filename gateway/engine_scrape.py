"""Engine telemetry: every replica engine's own ``/metrics``, read into its ``ReplicaState`` on the event loop.

Every ``interval_s`` the replicas of the current runtime are read concurrently over the gateway's client
session (a short timeout each), parsed by their pool's engine kind (fleet.engines.metrics) and stored
on the replica: ``engine`` (the record) and ``foreign_requests`` (what the engine holds beyond the
gateway's own in flight there, which the router counts as load). The event loop is the only writer of
replicas, and every write here happens in this task on the loop.

A replica whose ``/metrics`` cannot be read keeps its last record for ``stale_after_intervals``
intervals, then ``engine`` is None and ``foreign_requests`` 0: it is routed by the gateway's own
counts. Each failed read is counted (``polymorph_engine_scrape_failures_total``) and the last reason
is kept for ``GET /admin/state``.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from fleet.engines.load import EngineLoad
from fleet.engines.metrics import parse_load, prefix_hit_fraction
from fleet.pool import ReplicaState
from fleet.router import foreign_requests
from gateway.background import BackgroundTask

if TYPE_CHECKING:
    from gateway.state import GatewayState

# The client session does not decompress (the proxy passes bodies through as they come); engines that
# serve /metrics with prometheus_client would gzip it for a client that accepts gzip.
_HEADERS = {"Accept-Encoding": "identity"}
NOT_READ_YET = "its /metrics has not been read yet"  # a replica's error until its first read


@dataclass(slots=True)
class _Track:
    """What the scraper remembers of one replica between rounds (loop-owned)."""

    last: EngineLoad | None = None  # the last record read, kept past staleness for the next hit fraction
    error: str | None = None  # why the last read failed; None when it succeeded
    hit_fraction: float | None = None  # prefix-cache hits over lookups between the last two reads that had lookups


class EngineScraper:
    def __init__(self, state: GatewayState, interval_s: float = 1.0, timeout_s: float | None = None, stale_after_intervals: int = 3) -> None:
        if interval_s <= 0 or stale_after_intervals < 1:
            raise ValueError("interval_s must be positive and stale_after_intervals at least 1")
        self.state = state
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s if timeout_s is not None else min(1.0, interval_s))
        self.stale_after_s = stale_after_intervals * interval_s
        self.task = BackgroundTask(self.run)
        self._tracks: dict[tuple[str, str, str], _Track] = {}

    def error_of(self, replica: ReplicaState) -> str | None:
        """Why ``replica``'s engine figures are not current, or None when its last read succeeded."""
        track = self._tracks.get((replica.pool, replica.name, replica.url))
        if track is None:
            return NOT_READ_YET
        return track.error

    def hit_fraction_of(self, replica: ReplicaState) -> float | None:
        track = self._tracks.get((replica.pool, replica.name, replica.url))
        return track.hit_fraction if track is not None else None

    async def scrape_once(self) -> None:
        """Read every replica's /metrics once, concurrently, and store what was read."""
        pools = self.state.runtime.pools
        replicas = [(pool.engine_kind, r) for pool in pools for r in pool.replicas]
        await asyncio.gather(*(self._scrape(kind, r) for kind, r in replicas))
        current = {(r.pool, r.name, r.url) for _, r in replicas}
        for key in [k for k in self._tracks if k not in current]:  # replicas gone with a reload or a move
            del self._tracks[key]
            self._drop_figures(key[0], key[1])
            self.state.metrics.drop(self.state.metrics.engine_up, key[0], key[1])

    async def _scrape(self, kind: str, replica: ReplicaState) -> None:
        session = self.state.session
        assert session is not None
        loop = asyncio.get_running_loop()
        try:
            load = await read_engine_load(session, replica.url, kind, self.timeout, loop.time())
        except EngineUnreadable as exc:
            self._failed(replica, str(exc), loop.time())
        else:
            self._read(replica, load)

    def _track(self, replica: ReplicaState) -> _Track:
        key = (replica.pool, replica.name, replica.url)
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track()
        return track

    def _read(self, replica: ReplicaState, load: EngineLoad) -> None:
        track = self._track(replica)
        hit = prefix_hit_fraction(track.last, load)
        if hit is not None:
            track.hit_fraction = hit
        track.last, track.error = load, None
        replica.engine = load
        replica.foreign_requests = foreign_requests(load, replica.num_in_flight)
        m, labels = self.state.metrics, (replica.pool, replica.name)
        m.child(m.engine_up, *labels).set(1)
        m.child(m.engine_running, *labels).set(load.num_running)
        m.child(m.engine_waiting, *labels).set(load.num_waiting)
        if load.kv_usage_fraction is not None:
            m.child(m.engine_kv_usage, *labels).set(load.kv_usage_fraction)
        if track.hit_fraction is not None:
            m.child(m.engine_prefix_hits, *labels).set(track.hit_fraction)

    def _failed(self, replica: ReplicaState, reason: str, now: float) -> None:
        track = self._track(replica)
        track.error = reason
        m, labels = self.state.metrics, (replica.pool, replica.name)
        m.child(m.engine_scrape_failures, *labels).inc()
        m.child(m.engine_up, *labels).set(0)
        if replica.engine is not None and now - replica.engine.scraped_at < self.stale_after_s:
            return  # one missed read: the last figures still stand
        replica.engine = None
        replica.foreign_requests = 0
        track.hit_fraction = None
        self._drop_figures(*labels)

    def _drop_figures(self, pool: str, replica: str) -> None:
        m = self.state.metrics
        for family in (m.engine_running, m.engine_waiting, m.engine_kv_usage, m.engine_prefix_hits):
            m.drop(family, pool, replica)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.scrape_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # telemetry must never stop for good
                print(f"polymorph: engine metrics round failed: {exc!r}", file=sys.stderr)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def start(self) -> None:
        self.task.start()

    async def stop(self) -> None:
        await self.task.stop()


class EngineUnreadable(Exception):
    """An engine's ``/metrics`` could not be read or parsed; the message says why."""


async def read_engine_load(session: aiohttp.ClientSession, url: str, kind: str, timeout: aiohttp.ClientTimeout, now: float) -> EngineLoad:
    """One read of the ``/metrics`` of the engine of ``kind`` at ``url``, stamped ``now`` (the gateway's
    scraper and the external controller's, gateway.controller_service)."""
    try:
        async with session.get(url + "/metrics", timeout=timeout, headers=_HEADERS) as resp:
            body = await resp.read()
            status = resp.status
    except TimeoutError:
        raise EngineUnreadable(f"GET /metrics timed out after {timeout.total:g} s") from None
    except aiohttp.ClientError as exc:
        raise EngineUnreadable(f"GET /metrics failed: {exc}") from None
    if status != 200:
        raise EngineUnreadable(f"GET /metrics answered HTTP {status}")
    try:
        return parse_load(kind, body.decode("utf-8", "replace"), now)
    except ValueError as exc:
        raise EngineUnreadable(f"/metrics unreadable as {kind}: {exc}") from None
