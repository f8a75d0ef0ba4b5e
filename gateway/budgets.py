"""Tenants' monthly budgets: what each has spent this period, and the 429 once it reaches its budget.

The period is the calendar month in UTC, read off an injected wall clock. The spend is one figure per
tenant however the gateway runs, as the rate limits are: ``SpendLedger`` in the process (``--workers 1``),
``SharedSpendLedger`` in the free slot of each tenant's row of the shared limits table (``--workers N``).
A reload builds a new runtime that takes the previous runtime's ledger (gateway.runtime), so a reload
never resets a spend. Requests already in flight when the budget is reached finish and are charged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from gateway.admission import Refusal
from gateway.config import Tenant
from gateway.limits_shared import SPARE_SLOT, SharedLimitTable

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Period:
    """One budget period: the calendar month in UTC holding some instant."""

    key: str  # "2026-12"
    index: int  # months since year 0: the next period's is one more
    end_s: float  # its end (the next month's start), Unix seconds


def period_of(wall_s: float) -> Period:
    at = datetime.fromtimestamp(wall_s, UTC)
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    return Period(f"{at.year:04d}-{at.month:02d}", at.year * 12 + at.month - 1, datetime(year, month, 1, tzinfo=UTC).timestamp())


@dataclass(frozen=True, slots=True)
class TenantSpend:
    """A tenant's spend in the current period, as /admin/state shows it."""

    period: str
    spent_usd: float
    budget_usd: float | None

    @property
    def remaining_usd(self) -> float | None:
        return None if self.budget_usd is None else max(0.0, self.budget_usd - self.spent_usd)


class SpendBook(Protocol):
    def add(self, tenant: str, usd: float) -> None: ...
    def spent_usd(self, tenant: str) -> float: ...
    def period(self) -> Period: ...
    async def refresh(self, tenant: str) -> None: ...  # read what other gateways charged (a store's round trip)


class SpendLedger:
    """This process's spend per tenant in the current period (the older periods' are dropped)."""

    def __init__(self, wall: Clock = time.time) -> None:
        self.wall = wall
        self._period = period_of(wall())
        self._spent_usd: dict[str, float] = {}

    def period(self) -> Period:
        now = self.wall()
        if now >= self._period.end_s:
            self._period, self._spent_usd = period_of(now), {}
        return self._period

    def add(self, tenant: str, usd: float) -> None:
        self.period()
        self._spent_usd[tenant] = self._spent_usd.get(tenant, 0.0) + usd

    def spent_usd(self, tenant: str) -> float:
        self.period()
        return self._spent_usd.get(tenant, 0.0)

    async def refresh(self, tenant: str) -> None:
        return None  # this process is the only one charging


# The shared slot holds the period and the spend in one int64, so one write under the table's lock
# moves both: the period's index above bit 47, the spend in units of 1e-8 USD in the low 47 bits
# (up to about 1.4 million USD a tenant a month; beyond, it stays there).
_UNITS_PER_USD = 1e8
_SPEND_BITS = 47
_SPEND_MASK = (1 << _SPEND_BITS) - 1


class SharedSpendLedger:
    """The spend in the tenants' rows of the ``--workers`` shared limits table (one figure for all workers)."""

    def __init__(self, table: SharedLimitTable, tenants: tuple[Tenant, ...], now: float, wall: Clock = time.time) -> None:
        self.table, self.wall = table, wall
        # the same rows the tenants' limiters bind (binding with the tenant's own limits changes nothing there)
        self.slot_of = {t.name: table.bind(t, now) * 8 + SPARE_SLOT for t in tenants}

    def period(self) -> Period:
        return period_of(self.wall())

    def _read(self, slot: int, index: int) -> int:
        packed = self.table.ints[slot]
        return packed & _SPEND_MASK if packed >> _SPEND_BITS == index else 0

    def add(self, tenant: str, usd: float) -> None:
        slot = self.slot_of.get(tenant)
        if slot is None:
            return
        index = self.period().index
        with self.table.lock:
            units = min(_SPEND_MASK, self._read(slot, index) + round(usd * _UNITS_PER_USD))
            self.table.ints[slot] = (index << _SPEND_BITS) | units

    def spent_usd(self, tenant: str) -> float:
        slot = self.slot_of.get(tenant)
        return 0.0 if slot is None else self._read(slot, self.period().index) / _UNITS_PER_USD

    async def refresh(self, tenant: str) -> None:
        return None  # every worker charges the same shared slot


def tenant_spend(book: SpendBook, tenant: Tenant) -> TenantSpend:
    return TenantSpend(book.period().key, book.spent_usd(tenant.name), tenant.budget_monthly_usd)


def budget_refusal(book: SpendBook, tenant: Tenant, wall_s: float) -> Refusal | None:
    """429 ``budget_exceeded`` for a tenant whose spend this period has reached its budget; Retry-After is the period's end."""
    budget = tenant.budget_monthly_usd
    if budget is None:
        return None
    spent = book.spent_usd(tenant.name)
    if spent < budget:
        return None
    period = book.period()
    resets = datetime.fromtimestamp(period.end_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Refusal("budget_exceeded", f"Tenant {tenant.name!r} has spent {spent:.4f} USD of its {budget:g} USD budget for {period.key}; "
                   f"the budget resets at {resets}.", max(1.0, period.end_s - wall_s))
