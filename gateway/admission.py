"""Per-tenant limits: token buckets for requests and tokens per minute, and a concurrency cap.

Decisions take the clock as an argument, so the same objects are exact under test. ``TenantLimiter``
keeps them in this process (one gateway process, the default); ``gateway.limits_shared`` keeps them in
shared memory for the ``--workers`` of one host and ``gateway.limits_store`` in Redis for several hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.config import Tenant


class TokenBucket:
    """Refills ``rate_per_s`` up to ``burst``; ``take`` spends or says how long until it could."""

    __slots__ = ("rate_per_s", "burst", "level", "updated_at")

    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.level = burst
        self.updated_at = now

    def _refill(self, now: float) -> None:
        if now > self.updated_at:
            self.level = min(self.burst, self.level + (now - self.updated_at) * self.rate_per_s)
            self.updated_at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` could be taken (0 when it can be now)."""
        self._refill(now)
        if self.level >= amount:
            return 0.0
        return (min(amount, self.burst) - self.level) / self.rate_per_s

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str
    message: str
    retry_after_s: float


def refusal(code: str, tenant: Tenant, num_in_flight: int, retry_after_s: float) -> Refusal:
    """The answer to a request over ``tenant``'s limit ``code``, wherever the limit was decided."""
    if code == "concurrency_limit_exceeded":
        message = f"Tenant {tenant.name!r} already has {num_in_flight} requests in flight (limit {tenant.max_concurrency})."
    elif code == "rate_limit_exceeded":
        message = f"Tenant {tenant.name!r} exceeded {tenant.requests_per_min:g} requests per minute."
    else:
        message = f"Tenant {tenant.name!r} exceeded {tenant.tokens_per_min:g} tokens per minute."
    return Refusal(code, message, retry_after_s)


class Limiter(Protocol):
    """A tenant's limits as the request path uses them: ``admit`` (or, where ``synchronous`` is false
    because the decision is a store's round trip, ``await admit_async``), then ``release`` once."""

    @property
    def tenant(self) -> Tenant: ...
    @property
    def synchronous(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    def retarget(self, tenant: Tenant) -> None: ...
    def admit(self, num_tokens: int, now: float) -> Refusal | None: ...
    async def admit_async(self, num_tokens: int, now: float) -> Refusal | None: ...
    def release(self) -> None: ...


class TenantLimiter:
    """The live limit state of one tenant. Rebuilt on reload only when the tenant's limits change."""

    __slots__ = ("tenant", "requests", "tokens", "num_in_flight")
    synchronous = True

    def __init__(self, tenant: Tenant, now: float) -> None:
        self.tenant = tenant
        # A minute's allowance is the burst: a tenant may use its whole per-minute budget at once.
        self.requests = TokenBucket(tenant.requests_per_min / 60.0, tenant.requests_per_min, now)
        self.tokens = TokenBucket(tenant.tokens_per_min / 60.0, tenant.tokens_per_min, now)
        self.num_in_flight = 0

    def retarget(self, tenant: Tenant) -> None:
        """The same limits under an edited tenant (its models or tiers changed): keep the budgets."""
        self.tenant = tenant

    def admit(self, num_tokens: int, now: float) -> Refusal | None:
        """Take one request and ``num_tokens`` from the budgets, or say why not (taking nothing)."""
        if self.num_in_flight >= self.tenant.max_concurrency:
            return refusal("concurrency_limit_exceeded", self.tenant, self.num_in_flight, 1.0)
        wait_s = self.requests.wait_s(1.0, now)
        if wait_s > 0:
            return refusal("rate_limit_exceeded", self.tenant, self.num_in_flight, wait_s)
        wait_s = self.tokens.wait_s(float(num_tokens), now)
        if wait_s > 0:
            return refusal("token_rate_limit_exceeded", self.tenant, self.num_in_flight, wait_s)
        self.requests.take(1.0, now)
        self.tokens.take(float(num_tokens), now)
        self.num_in_flight += 1
        return None

    async def admit_async(self, num_tokens: int, now: float) -> Refusal | None:
        return self.admit(num_tokens, now)

    def release(self) -> None:
        self.num_in_flight -= 1
