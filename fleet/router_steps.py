"""The router's named steps, and ``compose``, which builds a ``Router`` from their names once.

``fleet.router.route`` runs five stages; each is a plain function with one job, chosen by name in
``RouterSettings`` (config ``router:``) from the registry ``STEPS``:

- ``pool_filter`` -- which pools may take the request. ``serves_model`` (default): every pool that
  serves the model. ``own_shape``: only the pools compiled for the request's shape when there are any
  (isolation: no overflow into other shapes' pools; they wait or shed at home), else every pool that
  serves the model.
- ``pool_scorer`` -- a sort key per pool, lowest first (skipped when one pool is left).
  ``slo_chance`` (default): the predicted chance that the request meets its tier's TTFT objective
  there (below); pools with a chance of at least ``good_chance`` come first: the shape's own pools by
  load, then other pools by cost per request (overflow takes the cheapest capacity that can serve
  it); below that, pools by chance. ``least_load``: pools by load alone (the shape's own first among
  equals), blind to SLO chance and cost.
- ``admission`` -- with tiers, whether the request runs now, waits, or is shed.
  ``queue_or_shed`` (default): if the best pool is saturated and keeps a queue (``PoolState.queue``),
  ``Wait`` there (by priority and deadline, until a replica has room; fleet.queueing sheds whoever's
  deadline passes first, so ``batch`` waits behind ``interactive`` and is shed before it), or a 429
  ``shed`` at once when the chance is below ``shed_chance`` (it would only expire in the queue).
  Without a queue, a request of a tier at or below ``shed_priority`` (``batch`` by default) is shed
  with 429 and ``Retry-After`` once every pool it could use is at ``shed_load_fraction`` or more,
  while higher tiers are still placed. ``shed_only``: that last rule alone, queues or not (a full
  pool's engines queue the rest). ``admit_all``: place every request (engines queue; nothing is shed).
- ``replica_filter`` -- which replicas of a pool may take it. ``untried_routable`` (default): serves
  the model, routable (not draining, breaker closed), not already tried for this request.
  ``routable``: the same, tried ones included (a retry may return to a pool's only replica).
- ``replica_picker`` -- one of those (called with two or more). ``prefix_affinity`` (default): the
  request's prefix fingerprint ranks replicas by rendezvous hashing and the top-ranked one is taken
  unless it carries more than ``affinity_slack`` times the pool's mean load (consistent hashing with
  bounded load), so prefix caches get hits without hot-spotting; without a prefix, or when every
  ranked replica is over the bound, ``least_work``. ``least_work``: least outstanding work (predicted
  tokens, each foreign request taken as long as this one), then fewest requests; no affinity.

All steps are deterministic (ties fall to list order). ``compose`` runs once per ``RouterSettings``
(its ``__post_init__``), so a request pays attribute reads, never a lookup by name.

The SLO chance is a closed form on the hot path: a pool whose routable replicas carry less than
``max_running_per_replica`` work each starts the request at once (the capacity model sized that
concurrency to meet the SLO); otherwise it waits for the ``k`` units of work ahead of it beyond that
limit to leave (in flight, plus queued requests of its priority or a more urgent one), and the pool
completes work at its capacity rate ``n x rate_per_replica_rps`` as a Poisson process, so the chance
is P(Poisson(rate x wait budget) >= k). In another shape's pool sized for a looser TPOT than the
request's tier's (``PoolState.tpot_objective_s``: a code pool at 100 ms, an interactive chat at 50 ms),
the request counts on that ratio of the slots only: a pool its own requests fill to their slower steps
would break the tighter objective. Work is counted in the pool's own requests (``work_units``:
another shape's request weighs its dominant length ratio to the pool's mean prompt and output), so
long prompts overflowing into a chat pool fill it as the prefill and KV they hold, not as one chat
each. The wait budget is ``wait_share`` of the tier's TTFT objective (the rest is the engine's own
queueing and prefill). Load is work in flight over the model's SLO concurrency, or per replica for
pools without a capacity model (an engine's ``max_running_requests`` is a batch cap, not a
capacity). Without a model a pool's chance is only "below its engines' batch cap", so an overflow
heavier than the pool's own requests (``work_units`` > 1: a long prompt into a chat pool, whose
prefill would stall the chats) is not sent there on that word alone: it stays in its own pools. No
per-request simulation: O(pools + replicas) arithmetic. A replica's work counts its engine's foreign
requests too (``ReplicaState.work_in_flight``, ``foreign_requests``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from classifiers.shape import Shape
from fleet.pool import PoolState, ReplicaState
from fleet.router_decisions import Reject, Wait
from kernels.tiers import TierSlo

S = TypeVar("S")


# --- the stages' signatures ----------------------------------------------------------------------


class PoolFilter(Protocol):
    def __call__(self, pools: Sequence[PoolState], shape: Shape, model: str) -> list[PoolState]: ...


class PoolScorer(Protocol):
    """A sort key (lowest first); ``slo``: the request's tier's objectives; ``has_own``: some candidate
    pool is compiled for the shape; ``work``: work_units(shape, pool)."""

    def __call__(
        self, pool: PoolState, shape: Shape, now: float, slo: TierSlo, wait_s: float, settings: RouterSettings, has_own: bool, work: float
    ) -> tuple[float, ...]: ...


class Admission(Protocol):
    """Wait or Reject to hold the request back, None to place it; ``ranked``: (pool, work) best first, never empty."""

    def __call__(
        self, shape: Shape, ranked: list[tuple[PoolState, float]], now: float, slo: TierSlo, wait_s: float, settings: RouterSettings,
        tiers: Mapping[str, TierSlo],
    ) -> Wait | Reject | None: ...


class ReplicaFilter(Protocol):
    def __call__(self, replicas: Sequence[ReplicaState], model: str, now: float, exclude: Collection[str]) -> list[ReplicaState]: ...


class ReplicaPicker(Protocol):
    """One of ``live`` (two or more replicas that passed the filter)."""

    def __call__(self, shape: Shape, live: list[ReplicaState], settings: RouterSettings) -> ReplicaState: ...


# --- pool filters --------------------------------------------------------------------------------


def serves_model(pools: Sequence[PoolState], shape: Shape, model: str) -> list[PoolState]:
    return [p for p in pools if p.serves(model)]


def own_shape(pools: Sequence[PoolState], shape: Shape, model: str) -> list[PoolState]:
    serving = [p for p in pools if p.serves(model)]
    own = [p for p in serving if shape.name in p.shapes]
    return own or serving


# --- pool scorers --------------------------------------------------------------------------------


def slo_chance_score(
    pool: PoolState, shape: Shape, now: float, slo: TierSlo, wait_s: float, settings: RouterSettings, has_own: bool, work: float
) -> tuple[float, ...]:
    other = shape.name not in pool.shapes
    # Without a capacity model a pool's saturation is only its engines' batch cap, far past where its
    # own requests miss their SLO; an overflow heavier than those (a long prompt into a chat pool)
    # would stall them with its prefill, so only a model's word sends it there.
    heavy_unmodelled = has_own and other and work > 1.0 and pool.rate_per_replica_rps <= 0
    chance = 0.0 if heavy_unmodelled else slo_chance(pool, now, slo.priority, wait_s, work, request_slots(pool, shape, slo, settings, now))
    if chance >= settings.good_chance:
        return (0.0, float(other), pool.cost_per_request() if other else 0.0, _balance_load(pool, now))
    return (1.0, -chance, float(other), _balance_load(pool, now))


def least_load_score(
    pool: PoolState, shape: Shape, now: float, slo: TierSlo, wait_s: float, settings: RouterSettings, has_own: bool, work: float
) -> tuple[float, ...]:
    return (_balance_load(pool, now), float(shape.name not in pool.shapes))


# --- admission -----------------------------------------------------------------------------------


def queue_or_shed(
    shape: Shape, ranked: list[tuple[PoolState, float]], now: float, slo: TierSlo, wait_s: float, settings: RouterSettings,
    tiers: Mapping[str, TierSlo],
) -> Wait | Reject | None:
    best, work = ranked[0]
    n = best.num_routable(now)
    slots = slots_per_replica(best, slo.priority, settings, now)
    if best.queue is not None and n > 0 and _num_to_leave(best, now, slo.priority, n, work, slots) > 0:
        chance = slo_chance(best, now, slo.priority, wait_s, work, slots)
        if chance < settings.shed_chance and best.rate_per_replica_rps > 0:
            return Reject(429, "shed", f"capacity is short; a tier {shape.tier!r} request would miss its SLO",
                          max(settings.shed_retry_after_s, _clear_s(best, now, slo.priority, work, slots)))
        return Wait(best.name, slo.priority, now + wait_s, chance, overflow=shape.name not in best.shapes)
    return shed_only(shape, ranked, now, slo, wait_s, settings, tiers)


def shed_only(
    shape: Shape, ranked: list[tuple[PoolState, float]], now: float, slo: TierSlo, wait_s: float, settings: RouterSettings,
    tiers: Mapping[str, TierSlo],
) -> Wait | Reject | None:
    tier = tiers.get(shape.tier)  # a tier the config does not name is never shed
    if tier is None or tier.priority < settings.shed_priority:
        return None
    if all(p.load_fraction(now) >= settings.shed_load_fraction for p, _ in ranked):
        return Reject(429, "shed", f"capacity is short; tier {shape.tier!r} is shed first", settings.shed_retry_after_s)
    return None


def admit_all(
    shape: Shape, ranked: list[tuple[PoolState, float]], now: float, slo: TierSlo, wait_s: float, settings: RouterSettings,
    tiers: Mapping[str, TierSlo],
) -> Wait | Reject | None:
    return None


# --- replica filters -----------------------------------------------------------------------------


def untried_routable(replicas: Sequence[ReplicaState], model: str, now: float, exclude: Collection[str]) -> list[ReplicaState]:
    return [r for r in replicas if r.name not in exclude and r.serves(model) and r.routable(now)]


def routable(replicas: Sequence[ReplicaState], model: str, now: float, exclude: Collection[str]) -> list[ReplicaState]:
    return [r for r in replicas if r.serves(model) and r.routable(now)]


# --- replica pickers -----------------------------------------------------------------------------


def prefix_affinity(shape: Shape, live: list[ReplicaState], settings: RouterSettings) -> ReplicaState:
    if shape.prefix_fp:
        bound = settings.affinity_slack * (sum(r.num_in_flight + r.foreign_requests for r in live) / len(live) + 1.0)
        ranked = sorted(live, key=lambda r: _mix64(shape.prefix_fp ^ r.affinity_salt), reverse=True)
        for replica in ranked:
            if replica.num_in_flight + replica.foreign_requests < bound:
                return replica
    return least_work(shape, live, settings)


def least_work(shape: Shape, live: list[ReplicaState], settings: RouterSettings) -> ReplicaState:
    # A foreign request's length is unknown: each is taken to be as long as this one.
    size = shape.prompt_tokens + shape.predicted_output_p50
    return min(live, key=lambda r: (r.outstanding_tokens + r.foreign_requests * size, r.num_in_flight + r.foreign_requests))


# --- composition ---------------------------------------------------------------------------------


POOL_FILTERS: Final[Mapping[str, PoolFilter]] = {"serves_model": serves_model, "own_shape": own_shape}
POOL_SCORERS: Final[Mapping[str, PoolScorer]] = {"slo_chance": slo_chance_score, "least_load": least_load_score}
ADMISSIONS: Final[Mapping[str, Admission]] = {"queue_or_shed": queue_or_shed, "shed_only": shed_only, "admit_all": admit_all}
REPLICA_FILTERS: Final[Mapping[str, ReplicaFilter]] = {"untried_routable": untried_routable, "routable": routable}
REPLICA_PICKERS: Final[Mapping[str, ReplicaPicker]] = {"prefix_affinity": prefix_affinity, "least_work": least_work}
# Each stage's RouterSettings field and its known step names (the first is the default), for config errors.
STEPS: Final[Mapping[str, Mapping[str, object]]] = {
    "pool_filter": POOL_FILTERS, "pool_scorer": POOL_SCORERS, "admission": ADMISSIONS,
    "replica_filter": REPLICA_FILTERS, "replica_picker": REPLICA_PICKERS,
}


@dataclass(frozen=True, slots=True)
class Router:
    """The composed steps: what route() and pick_replica() call, in this order."""

    pool_filter: PoolFilter
    pool_scorer: PoolScorer
    admission: Admission
    replica_filter: ReplicaFilter
    replica_picker: ReplicaPicker


def compose(settings: RouterSettings) -> Router:
    """The steps ``settings`` names; ValueError naming the stage and its known steps for an unknown name."""
    return Router(
        _step(POOL_FILTERS, "pool_filter", settings.pool_filter),
        _step(POOL_SCORERS, "pool_scorer", settings.pool_scorer),
        _step(ADMISSIONS, "admission", settings.admission),
        _step(REPLICA_FILTERS, "replica_filter", settings.replica_filter),
        _step(REPLICA_PICKERS, "replica_picker", settings.replica_picker),
    )


def _step(registry: Mapping[str, S], stage: str, name: str) -> S:
    step = registry.get(name)
    if step is None:
        raise ValueError(f"unknown {stage} {name!r} (known: {', '.join(registry)})")
    return step


@dataclass(frozen=True, slots=True)
class RouterSettings:
    affinity_slack: float = 1.5
    shed_priority: int = 2  # tiers at this priority or lower (a larger number) are shed first
    shed_load_fraction: float = 1.0
    shed_retry_after_s: float = 2.0  # the least Retry-After a shed answer carries
    good_chance: float = 0.9  # a pool at least this likely to meet the SLO is good enough: own shape, then cost
    shed_chance: float = 0.05  # below this, a request is shed at once instead of waiting in a queue
    wait_share: float = 0.5  # share of the tier's TTFT objective a request may spend waiting for a replica
    # Share of each replica's running slots (``max_running_per_replica``) that tiers at or below
    # ``shed_priority`` may not take, in pools that keep a queue: a batch flood then leaves room in the
    # engine's batch, and a more urgent request starts at its next step instead of waiting for a batch
    # request to finish (an engine's priority scheduler orders its waiting queue but does not preempt a
    # full batch for a newcomer). 0 (default): batch may fill the slots; its throughput then pays nothing
    # when no urgent traffic comes. See `polymorph bench priority` for the measured trade-off.
    urgent_reserve: float = 0.0
    # How far back the gateway looks for the most urgent requests a pool had in flight at once: with
    # ``urgent_reserve`` > 0 each replica keeps that many slots (spread over its replicas), plus one,
    # from batch when that is more than the share (fleet.urgent_demand). 0: measure nothing (the share alone).
    urgent_window_s: float = 30.0
    # Share of a modelled pool's running slots another shape's request (an overflow) may count on; the
    # rest stays for the pool's own shape, whose next requests would otherwise find it full of heavier
    # overflow and be shed (fleet.router_steps.request_slots). 1: overflow may fill the pool.
    overflow_share: float = 0.5
    # The steps, by name (fleet.router_steps.STEPS lists each stage's; these are the defaults).
    pool_filter: str = "serves_model"
    pool_scorer: str = "slo_chance"
    admission: str = "queue_or_shed"
    replica_filter: str = "untried_routable"
    replica_picker: str = "prefix_affinity"
    steps: Router = field(init=False, repr=False, compare=False)  # the named steps, composed once

    def __post_init__(self) -> None:
        if not 0.0 < self.overflow_share <= 1.0:
            raise ValueError(f"overflow_share must be in (0, 1], got {self.overflow_share}")
        object.__setattr__(self, "steps", compose(self))  # frozen: set once here, only read per request


# --- the closed forms the steps share ------------------------------------------------------------


def slots_per_replica(pool: PoolState, priority: int, settings: RouterSettings, now: float) -> float:
    """The running slots per replica a request of ``priority`` may take in ``pool``: all of them, less the
    reserve for tiers at or below ``shed_priority`` in a pool with a queue (at least one). The reserve
    is the ``urgent_reserve`` share, or, when more, the urgent requests per replica the pool had in
    flight at once lately (``pool.urgent_demand``) plus one: room for the next one to start at once."""
    if settings.urgent_reserve <= 0 or priority < settings.shed_priority or pool.queue is None:
        return pool.max_running_per_replica
    slots = math.floor(pool.max_running_per_replica * (1.0 - settings.urgent_reserve))
    peak = pool.urgent_demand.peak(now) if pool.urgent_demand is not None else 0
    if peak:
        slots = min(slots, pool.max_running_per_replica - math.ceil(peak / max(1, pool.num_routable(now))) - 1)
    return max(1, slots)


def request_slots(pool: PoolState, shape: Shape, slo: TierSlo, settings: RouterSettings, now: float) -> float:
    """The running slots per replica a request of ``shape`` and tier ``slo`` counts on in ``pool``:
    ``slots_per_replica`` in a pool of its own shape; in another shape's pool, the smaller of two shares.

    - With a capacity model, ``settings.overflow_share``: the rest stays for the pool's own requests.
      Heavy overflow counted in work units fills a pool, and its own requests that come next are shed
      (a 1 s TTFT cannot wait for a document to finish). Stretched drift-ramp at x1.19 after the ramp:
      1.56 of 7.2 chats/s shed by a pool rated for 70, 2.2 of 11.7 code requests/s by a code pool
      documents had filled; with half, 0 and 0.5 (fleet/README.md "Overflow keeps to part of a pool").
    - In a pool sized for a looser TPOT than the request's tier's, that ratio: the pool runs as many
      requests as keep its own TPOT, and decode steps that slow break a tighter objective (step time
      taken as growing with the batch). Chats that spilled into code and long-context pools met 19%
      and 45% of their objectives without it."""
    slots = slots_per_replica(pool, slo.priority, settings, now)
    if shape.name in pool.shapes:
        return slots
    share = settings.overflow_share if pool.shapes and pool.rate_per_replica_rps > 0 else 1.0
    if 0.0 < slo.tpot_p99_s < pool.tpot_objective_s:
        share = min(share, slo.tpot_p99_s / pool.tpot_objective_s)
    return slots if share >= 1.0 else max(1.0, math.floor(slots * share))


def slo_chance(pool: PoolState, now: float, priority: int, wait_s: float, work: float = 1.0, slots: float | None = None) -> float:
    """Predicted chance that a request of ``priority`` and ``work`` gets a running slot in ``pool`` within
    ``wait_s``; ``slots``: the running slots per replica it may take (default all)."""
    n = pool.num_routable(now)
    if n == 0:
        return 0.0
    k = _num_to_leave(pool, now, priority, n, work, pool.max_running_per_replica if slots is None else slots)
    if k <= 0:
        return 1.0
    return poisson_at_least(k, n * pool.rate_per_replica_rps * wait_s)


def poisson_at_least(k: int, mean: float) -> float:
    """P(N >= k) for N ~ Poisson(mean): exact up to mean 100; above it, as P(chi2 with 2k degrees of
    freedom <= 2 mean) by the Wilson-Hilferty cube-root approximation (O(1), tails within ~1%)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    if mean > 100.0:
        spread = 2.0 / (18.0 * k)
        z = ((mean / k) ** (1.0 / 3.0) - (1.0 - spread)) / math.sqrt(spread)
        return 0.5 * math.erfc(-z / math.sqrt(2.0))
    if k > mean + 10.0 * math.sqrt(mean) + 10.0:
        return 0.0  # beyond ten standard deviations: below 1e-20
    term = total = math.exp(-mean)
    for i in range(1, k):
        term *= mean / i
        total += term
    return max(0.0, 1.0 - total)


def work_units(shape: Shape, pool: PoolState) -> float:
    """One request's share of ``pool``'s concurrency, in units of the pool's own requests.

    The capacity model sized ``max_running_per_replica`` and the rate for the pool's own shape, so
    its requests count 1. Another shape's request (an overflow) counts its dominant length ratio to
    the pool's mean prompt and output, at least 1: a 6k-token prompt in a pool sized for 1k-token
    chats holds six chats' worth of prefill and KV. A pool without a capacity model's means is
    judged by the requests it holds now (predicted prompt + output tokens per request in flight);
    an idle one counts every request 1.
    """
    if shape.name in pool.shapes:
        return 1.0
    if pool.mean_prompt_tokens > 0 and pool.mean_output_tokens > 0:
        return max(1.0, shape.prompt_tokens / pool.mean_prompt_tokens, shape.predicted_output_p50 / pool.mean_output_tokens)
    num_in_flight = pool.num_in_flight
    tokens = sum(r.outstanding_tokens for r in pool.replicas)
    if num_in_flight <= 0 or tokens <= 0:
        return 1.0
    return max(1.0, (shape.prompt_tokens + shape.predicted_output_p50) * num_in_flight / tokens)


def _num_to_leave(pool: PoolState, now: float, priority: int, num_routable: int, work: float, slots: float) -> int:
    """Own-shape requests that must leave ``pool`` before a newcomer of ``priority`` and ``work`` runs,
    when it may take ``slots`` running slots per replica."""
    in_flight = sum(r.work_in_flight for r in pool.replicas if r.routable(now))
    ahead = in_flight + (pool.queue.num_ahead(priority) if pool.queue is not None else 0)
    return math.ceil(ahead + work - num_routable * slots - 1e-9)


def _clear_s(pool: PoolState, now: float, priority: int, work: float, slots: float) -> float:
    """Expected time until a newcomer of ``priority`` would get a slot: when to retry."""
    n = pool.num_routable(now)
    rate = n * pool.rate_per_replica_rps
    return max(0, _num_to_leave(pool, now, priority, n, work, slots)) / rate if rate > 0 else 0.0


def _balance_load(pool: PoolState, now: float) -> float:
    """What pools of equal standing are balanced on: work in flight over the capacity model's SLO
    concurrency; without a capacity model, per routable replica. An engine's ``max_running_requests``
    is a batch cap (a long-context config sets it low to keep KV for long prompts), not its capacity:
    dividing by it sent four times as much work to a chat pool with 256 as to a long-context pool
    with 64, long prompts included. An operator's ``max_in_flight_per_replica`` is a capacity."""
    if pool.knows_capacity:
        return pool.load_fraction(now)
    n = pool.num_routable(now)
    return pool.work_in_flight / n if n else math.inf


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a well-spread, process-independent rank for rendezvous hashing."""
    z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
