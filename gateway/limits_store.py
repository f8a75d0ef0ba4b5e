"""Tenant limits kept in Redis (``limits: {store: redis://...}``), shared by every gateway process on every host.

One Lua script per admit decides the concurrency cap and both buckets atomically with the server's clock
(``TIME``), so the hosts' clocks never matter. Requests in flight are counted per gateway process (a field
of the tenant's in-flight hash) and held under that gateway's lease (a sorted set of lease expiries, renewed
by every admit and by a heartbeat): a gateway that dies stops holding its requests when its lease lapses.

Every call is bounded (``call_timeout_s``). A failure or timeout marks the store down: the process then
decides with per-process limits of 1/(num_gateways x local workers) of each tenant's, says so once on
stderr and in ``polymorph_limits_store_up``, and probes the store until it answers; the probe that finds it
back also rewrites this gateway's in-flight counts, so what was admitted meanwhile is counted again. (An
admit or release on the wire while that probe runs can leave a count one off until its request ends.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import sys
from collections.abc import Coroutine, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.admission import Refusal, TenantLimiter, refusal
from gateway.config import LimitsSettings, Tenant
from gateway.limits_shared import limits_digest

# KEYS: the tenant's buckets (hash), its in-flight counts by gateway (hash), the gateways' leases (sorted set).
# ARGV: gateway id, requests/min, tokens/min, max concurrency, tokens asked, lease ttl s, limits digest,
# reset ("1": this gateway's limits for the tenant changed: size the buckets afresh unless another did).
# Returns {0, 0, in flight} when admitted, else {1 concurrency | 2 requests | 3 tokens, retry after ms, in flight}.
# The buckets are TenantLimiter's (gateway.admission): a minute's allowance is the burst.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local gw = ARGV[1]
local rpm, tpm, maxc, asked = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), gw)
local n = 0
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  local expiry = redis.call('ZSCORE', KEYS[3], held[i])
  if expiry and tonumber(expiry) >= now then
    n = n + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[2], held[i])
  end
end
if n >= maxc then return {1, 1000, n} end
local b = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt', 'lim')
local rl, rt, tl, tt = tonumber(b[1]), tonumber(b[2]), tonumber(b[3]), tonumber(b[4])
if not rl or (ARGV[8] == '1' and b[5] ~= ARGV[7]) then
  rl, rt, tl, tt = rpm, now, tpm, now
end
if now > rt then rl = math.min(rpm, rl + (now - rt) * rpm / 60); rt = now end
if now > tt then tl = math.min(tpm, tl + (now - tt) * tpm / 60); tt = now end
if rl < 1 then return {2, math.ceil((math.min(1, rpm) - rl) / (rpm / 60) * 1000), n} end
if tl < asked then return {3, math.ceil((math.min(asked, tpm) - tl) / (tpm / 60) * 1000), n} end
redis.call('HSET', KEYS[1], 'rl', rl - 1, 'rt', rt, 'tl', tl - asked, 'tt', tt, 'lim', ARGV[7])
redis.call('EXPIRE', KEYS[1], 120)
redis.call('HINCRBY', KEYS[2], gw, 1)
return {0, 0, n + 1}
"""

# KEYS[1]: a tenant's in-flight hash; ARGV[1]: gateway id.
_RELEASE = """
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""

# KEYS[1]: the leases; KEYS[2..]: in-flight hashes whose count for this gateway is ARGV[2..] ("-": leave it).
# ARGV[1]: gateway id, ARGV[#KEYS + 1]: lease ttl s. Renews the lease, drops lapsed ones, rewrites the counts.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local gw = ARGV[1]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[#KEYS + 1]), gw)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #KEYS do
  if ARGV[i] == '0' then redis.call('HDEL', KEYS[i], gw) elseif ARGV[i] ~= '-' then redis.call('HSET', KEYS[i], gw, ARGV[i]) end
end
return 0
"""

_CODES = {1: "concurrency_limit_exceeded", 2: "rate_limit_exceeded", 3: "token_rate_limit_exceeded"}
_DOWN_PROBE_S = 0.5  # how often a gateway in fallback asks whether the store is back


class LimitStore:
    """This process's link to the store: the client, its lease, whether the store answers, and the metrics."""

    def __init__(self, settings: LimitsSettings, num_local_workers: int) -> None:
        assert settings.store is not None
        self.settings = settings
        self.fallback_share = settings.num_gateways * max(1, num_local_workers)
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # redis is imported only by gateways that name a store: the others start without it
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisError

        self.failures: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        timeout_s = settings.call_timeout_s
        # no retries inside the client: a failed call is answered at once from the fallback limits
        self.client = aioredis.Redis.from_url(settings.store, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._admit = self.client.register_script(_ADMIT)
        self._release = self.client.register_script(_RELEASE)
        self._heartbeat = self.client.register_script(_HEARTBEAT)
        self.leases_key = f"{settings.key_prefix}:gateways"
        self.up = True  # until a call says otherwise
        self.limiters: Mapping[str, StoreTenantLimiter] = {}  # the current runtime's, for the heartbeat's counts
        self._loop_task: asyncio.Task[None] | None = None
        self._went_down = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._up_gauge: Any = None
        self._fallbacks: Any = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self._up_gauge = Gauge("polymorph_limits_store_up", "1 while the tenants' limits store answers, 0 while this gateway decides with its fallback share.",
                               registry=registry, multiprocess_mode="livemin")
        self._fallbacks = Counter("polymorph_limits_store_fallbacks", "Times a gateway process lost the limits store and fell back to its share of each limit.", registry=registry)
        self._up_gauge.set(1 if self.up else 0)

    def keys(self, tenant: str) -> tuple[str, str]:
        prefix = self.settings.key_prefix
        return f"{prefix}:tenant:{tenant}:buckets", f"{prefix}:tenant:{tenant}:in_flight"

    async def _bounded(self, work: Coroutine[Any, Any, Any]) -> Any:
        async with asyncio.timeout(self.settings.call_timeout_s):
            return await work

    async def call(self, work: Coroutine[Any, Any, Any]) -> Any:
        """``work`` bounded by the call timeout; None (and the store marked down) if it fails."""
        try:
            return await self._bounded(work)
        except self.failures as exc:
            self._down(exc)
            return None

    def _down(self, exc: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        self._went_down.set()
        if self._up_gauge is not None:
            self._up_gauge.set(0)
            self._fallbacks.inc()
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        print(f"polymorph: limits store {self.settings.store} unreachable ({reason}); this gateway process now keeps "
              f"1/{self.fallback_share} of each tenant's limits itself until the store answers", file=sys.stderr, flush=True)

    def ensure_running(self) -> None:
        """Start the heartbeat (and, while down, the probe) on the running loop, once."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._beat())

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self.call(work))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _beat(self) -> None:
        every_s = self.settings.lease_ttl_s / 3
        while True:
            if self.up:
                self._went_down.clear()
                with contextlib.suppress(TimeoutError):  # the lease's renewal is due; or the store went down: probe soon
                    async with asyncio.timeout(every_s):
                        await self._went_down.wait()
                if self.up:
                    await self.call(self._heartbeat(keys=[self.leases_key], args=[self.gateway_id, self.settings.lease_ttl_s]))
                    continue
            await asyncio.sleep(_DOWN_PROBE_S)
            limiters = list(self.limiters.values())
            keys = [self.leases_key, *(lim.in_flight_key for lim in limiters)]
            counts = [str(lim.local.num_in_flight) for lim in limiters]
            try:
                await self._bounded(self._heartbeat(keys=keys, args=[self.gateway_id, *counts, self.settings.lease_ttl_s]))
            except self.failures:
                continue
            self.up = True
            if self._up_gauge is not None:
                self._up_gauge.set(1)
            print(f"polymorph: limits store {self.settings.store} answers again; tenants' limits are shared through it", file=sys.stderr, flush=True)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.aclose()


class StoreTenantLimiter:
    """A tenant's limits decided by the store; while it is down, by ``local``: this process's share of them.

    ``local`` counts every request of the tenant this process has in flight, however it was admitted,
    so the fallback's concurrency share holds and the probe can tell the store what this gateway holds."""

    __slots__ = ("store", "tenant", "local", "buckets_key", "in_flight_key", "digest", "reset")
    synchronous = False

    def __init__(self, store: LimitStore, tenant: Tenant, now: float) -> None:
        self.store = store
        self.tenant = tenant
        self.local = TenantLimiter(self._share(tenant), now)
        self.buckets_key, self.in_flight_key = store.keys(tenant.name)
        self.digest = str(limits_digest(tenant))
        self.reset = True  # new limits (or a new gateway): the store sizes the buckets afresh unless another gateway already did

    @property
    def num_in_flight(self) -> int:
        return self.local.num_in_flight

    def _share(self, tenant: Tenant) -> Tenant:
        """``tenant`` with this process's share of its limits: what it may use while the store is down."""
        share = self.store.fallback_share
        return dataclasses.replace(tenant, requests_per_min=tenant.requests_per_min / share, tokens_per_min=tenant.tokens_per_min / share,
                                   max_concurrency=max(1, tenant.max_concurrency // share))

    def retarget(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.local.retarget(self._share(tenant))

    def admit(self, num_tokens: int, now: float) -> Refusal | None:
        """Decided here, with this process's share of the limits (what ``admit_async`` does while the store is down)."""
        return self.local.admit(num_tokens, now)

    async def admit_async(self, num_tokens: int, now: float) -> Refusal | None:
        store = self.store
        store.ensure_running()
        if not store.up:
            return self.local.admit(num_tokens, now)
        tenant = self.tenant
        args: list[str | int | float] = [store.gateway_id, tenant.requests_per_min, tenant.tokens_per_min, tenant.max_concurrency, num_tokens,
                store.settings.lease_ttl_s, self.digest, 1 if self.reset else 0]
        answer = await store.call(store._admit(keys=[self.buckets_key, self.in_flight_key, store.leases_key], args=args))
        if answer is None:  # the store just went down: this request is the fallback's first
            return self.local.admit(num_tokens, now)
        self.reset = False
        verdict, retry_after_ms, in_flight = int(answer[0]), int(answer[1]), int(answer[2])
        if verdict == 0:
            self.local.num_in_flight += 1
            return None
        return refusal(_CODES[verdict], tenant, in_flight, retry_after_ms / 1000)

    def release(self) -> None:
        self.local.num_in_flight -= 1
        store = self.store
        if store.up:  # while down the probe that finds the store back rewrites this gateway's counts
            store.spawn(store._release(keys=[self.in_flight_key], args=[store.gateway_id]))
