"""Tenants' spend kept in the limits store (``limits: {store: redis://...}``): one figure for every gateway.

Each charge is an INCRBYFLOAT on the tenant's key for the period (``<prefix>:spend:<tenant>:<period>``,
expiring a day after the period ends), sent after the response, off the request's path; its answer is
the total over all gateways, which this process keeps. Admitting a request of a tenant with a budget
reads the total first (one bounded GET). While the store does not answer, the process keeps the charges
itself and counts them on top of the last total it read, as the limits fall back to a share, and adds
them to the store with its next charge once the store answers again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.budgets import Clock, Period, period_of
from gateway.limits_store import LimitStore

# KEYS[1]: the tenant's spend this period; ARGV: USD to add, the key's expiry (Unix s). Returns the new total.
_ADD = """
local total = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIREAT', KEYS[1], ARGV[2])
return total
"""
_KEEP_AFTER_PERIOD_S = 86400.0


class StoreSpendLedger:
    def __init__(self, store: LimitStore, wall: Clock = time.time) -> None:
        self.store, self.wall = store, wall
        self._add = store.client.register_script(_ADD)
        self._period = period_of(wall())
        self._total_usd: dict[str, float] = {}  # the store's figure, as last read
        self._unsent_usd: dict[str, float] = {}  # charged while the store did not answer
        self._sending_usd: dict[str, float] = {}  # on the wire, not yet in a total read back
        self._background: set[asyncio.Task[None]] = set()

    def period(self) -> Period:
        now = self.wall()
        if now >= self._period.end_s:
            self._period, self._total_usd, self._unsent_usd, self._sending_usd = period_of(now), {}, {}, {}
        return self._period

    def _key(self, tenant: str, period: Period) -> str:
        return f"{self.store.settings.key_prefix}:spend:{tenant}:{period.key}"

    def spent_usd(self, tenant: str) -> float:
        self.period()
        return self._total_usd.get(tenant, 0.0) + self._unsent_usd.get(tenant, 0.0) + self._sending_usd.get(tenant, 0.0)

    def add(self, tenant: str, usd: float) -> None:
        period = self.period()
        self._unsent_usd[tenant] = self._unsent_usd.get(tenant, 0.0) + usd
        if not self.store.up:
            return
        amount, self._unsent_usd[tenant] = self._unsent_usd[tenant], 0.0
        self._sending_usd[tenant] = self._sending_usd.get(tenant, 0.0) + amount
        task = asyncio.get_running_loop().create_task(self._send(tenant, period, amount))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, tenant: str, period: Period, usd: float) -> None:
        answer: Any = await self.store.call(self._add(keys=[self._key(tenant, period)], args=[repr(usd), int(period.end_s + _KEEP_AFTER_PERIOD_S)]))
        if self.period() != period:
            return
        self._sending_usd[tenant] -= usd
        if answer is None:  # the store went down: keep the charge to send later
            self._unsent_usd[tenant] = self._unsent_usd.get(tenant, 0.0) + usd
        else:
            self._read(tenant, answer)

    def _read(self, tenant: str, total: Any) -> None:
        # totals only grow within a period: an answer overtaken by a later one's must not lower it
        self._total_usd[tenant] = max(self._total_usd.get(tenant, 0.0), float(total))

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _get(self, key: str) -> Any:
        return await self.store.client.get(key)

    async def refresh(self, tenant: str) -> None:
        """Read the tenant's total from the store (what the other gateways charged too)."""
        store = self.store
        store.ensure_running()
        if not store.up:
            return
        period = self.period()
        answer: Any = await store.call(self._get(self._key(tenant, period)))
        if answer is not None and self.period() == period:  # None: nothing charged yet, or the store went down
            self._read(tenant, answer)
