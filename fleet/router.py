"""Choose a pool and a replica for one request. Pure policy: state in, decision out, no I/O.

Pool choice scores every pool that serves the model by the predicted chance that this request meets
its tier's TTFT objective there (``slo_chance``), a closed form on the hot path: a pool whose
routable replicas carry less than ``max_running_per_replica`` work each starts it at once (the
capacity model sized that concurrency to meet the SLO); otherwise it waits for the ``k`` units of
work ahead of it beyond that limit to leave (in flight, plus queued requests of its priority or a
more urgent one), and the pool completes work at its capacity rate ``n x rate_per_replica_rps`` as
a Poisson process, so the chance is P(Poisson(rate x wait budget) >= k). Work is counted in the
pool's own requests (``work_units``: another shape's request weighs its dominant length ratio to
the pool's mean prompt and output), so long prompts overflowing into a chat pool fill it as the
prefill and KV they hold, not as one chat each. The wait budget is
``wait_share`` of the tier's TTFT objective (the rest is the engine's own queueing and prefill).
Pools with a chance of at least ``good_chance`` come first: the shape's own pools (compiled for it)
by load, then other pools by cost per request (overflow takes the cheapest capacity that can serve
it); below that, pools by chance. Load is work in flight over the model's SLO concurrency, or per
replica for pools without a capacity model (an engine's ``max_running_requests`` is a batch cap,
not a capacity). Without a model a pool's chance is only "below its engines' batch cap", so an
overflow heavier than the pool's own requests (``work_units`` > 1: a long prompt into a chat pool,
whose prefill would stall the chats) is not sent there on that word alone: it stays in its own
pools. No per-request simulation: O(pools + replicas) arithmetic.

Replica choice inside a pool is least outstanding work, with prefix affinity: the request's prefix
fingerprint ranks replicas by rendezvous hashing and the top-ranked one is taken unless it carries
more than ``affinity_slack`` times the pool's mean load (consistent hashing with bounded load), so
prefix caches get hits without hot-spotting. A replica's load is the gateway's own work in flight
plus its ``foreign_requests``: what its engine reported running and waiting at the last scrape of its
``/metrics`` beyond what this gateway had in flight there (another gateway or a client sharing the
engine), so requests we sent are never counted twice; without engine figures it is 0 and the
gateway's own counts decide, as before. Pool scores count it too (``ReplicaState.work_in_flight``).

When capacity is short, higher tiers go first. With ``tiers`` given and the best pool saturated:
if the pool keeps a queue (``PoolState.queue``), the answer is ``Wait`` (park it there, by priority
and deadline, until a replica has room; fleet.queueing sheds whoever's deadline passes first, so
``batch`` waits behind ``interactive`` and is shed before it), or a 429 ``shed`` at once when the
chance is below ``shed_chance`` (it would only expire in the queue). Without a queue, a request of
a tier at or below ``shed_priority`` (``batch`` by default) is shed with 429 and ``Retry-After`` once
every pool it could use is at ``shed_load_fraction`` or more, while higher tiers are still placed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from classifiers.shape import Shape
from fleet.engines.load import EngineLoad
from fleet.pool import PoolState, ReplicaState
from kernels.tiers import DEFAULT_TIERS, TierSlo, slo_for


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    replica: str
    url: str
    overflow: bool  # True when the shape's own pools were saturated or absent
    work: float = 1.0  # work_units(shape, pool): what the request weighs in its replica's books (begin/end)


@dataclass(frozen=True, slots=True)
class Wait:
    """Park the request in ``pool``'s queue until a replica has room, or shed it at ``deadline_at``."""

    pool: str
    priority: int
    deadline_at: float
    slo_chance: float
    overflow: bool


@dataclass(frozen=True, slots=True)
class Reject:
    status: int
    code: str
    reason: str
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class RouterSettings:
    affinity_slack: float = 1.5
    shed_priority: int = 2  # tiers at this priority or lower (a larger number) are shed first
    shed_load_fraction: float = 1.0
    shed_retry_after_s: float = 2.0  # the least Retry-After a shed answer carries
    good_chance: float = 0.9  # a pool at least this likely to meet the SLO is good enough: own shape, then cost
    shed_chance: float = 0.05  # below this, a request is shed at once instead of waiting in a queue
    wait_share: float = 0.5  # share of the tier's TTFT objective a request may spend waiting for a replica


def route(
    shape: Shape,
    model: str,
    pools: Sequence[PoolState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
    tiers: Mapping[str, TierSlo] | None = None,
) -> Route | Wait | Reject:
    """Pick where ``shape`` goes; ``exclude`` lists replica names already tried for this request;
    ``tiers`` (optional) enables waiting in pool queues and shedding when capacity is short."""
    serving = [p for p in pools if p.serves(model)]
    if not serving:
        return Reject(404, "model_not_found", f"no pool serves model {model!r}", 0.0)
    slo = slo_for(tiers or DEFAULT_TIERS, shape.tier)
    wait_s = settings.wait_share * slo.ttft_p99_s
    works = [work_units(shape, p) for p in serving]  # computed once: ranking, queueing and the route's books
    if len(serving) == 1:  # nothing to rank (one pool per model is common): spare the hot path the scoring
        ranked = [(serving[0], works[0])]
    else:
        has_own = any(shape.name in p.shapes for p in serving)
        scored = sorted((_rank(p, shape, now, slo.priority, wait_s, settings, has_own, works[i]), i, p) for i, p in enumerate(serving))
        ranked = [(p, works[i]) for _, i, p in scored]
    if tiers is not None:
        best, work = ranked[0]
        own = shape.name in best.shapes
        n = best.num_routable(now)
        if best.queue is not None and n > 0 and _num_to_leave(best, now, slo.priority, n, work) > 0:
            chance = slo_chance(best, now, slo.priority, wait_s, work)
            if chance < settings.shed_chance and best.rate_per_replica_rps > 0:
                return Reject(429, "shed", f"capacity is short; a tier {shape.tier!r} request would miss its SLO",
                              max(settings.shed_retry_after_s, _clear_s(best, now, slo.priority, work)))
            return Wait(best.name, slo.priority, now + wait_s, chance, overflow=not own)
        if _should_shed(shape, [p for p, _ in ranked], now, settings, tiers):
            return Reject(429, "shed", f"capacity is short; tier {shape.tier!r} is shed first", settings.shed_retry_after_s)
    for pool, work in ranked:
        replica = pick_replica(shape, model, pool.replicas, now, settings, exclude)
        if replica is not None:
            return Route(pool.name, replica.name, replica.url, overflow=shape.name not in pool.shapes, work=work)
    return Reject(503, "no_healthy_replica", f"no healthy replica can serve model {model!r} right now", 1.0)


def slo_chance(pool: PoolState, now: float, priority: int, wait_s: float, work: float = 1.0) -> float:
    """Predicted chance that a request of ``priority`` and ``work`` gets a running slot in ``pool`` within ``wait_s``."""
    n = pool.num_routable(now)
    if n == 0:
        return 0.0
    k = _num_to_leave(pool, now, priority, n, work)
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


def _num_to_leave(pool: PoolState, now: float, priority: int, num_routable: int, work: float) -> int:
    """Own-shape requests that must leave ``pool`` before a newcomer of ``priority`` and ``work`` runs."""
    in_flight = sum(r.work_in_flight for r in pool.replicas if r.routable(now))
    ahead = in_flight + (pool.queue.num_ahead(priority) if pool.queue is not None else 0)
    return math.ceil(ahead + work - num_routable * pool.max_running_per_replica - 1e-9)


def _clear_s(pool: PoolState, now: float, priority: int, work: float) -> float:
    """Expected time until a newcomer of ``priority`` would get a slot: when to retry."""
    n = pool.num_routable(now)
    rate = n * pool.rate_per_replica_rps
    return max(0, _num_to_leave(pool, now, priority, n, work)) / rate if rate > 0 else 0.0


def _rank(
    pool: PoolState, shape: Shape, now: float, priority: int, wait_s: float, settings: RouterSettings, has_own: bool, work: float
) -> tuple[float, ...]:
    other = shape.name not in pool.shapes
    # Without a capacity model a pool's saturation is only its engines' batch cap, far past where its
    # own requests miss their SLO; an overflow heavier than those (a long prompt into a chat pool)
    # would stall them with its prefill, so only a model's word sends it there.
    heavy_unmodelled = has_own and other and work > 1.0 and pool.rate_per_replica_rps <= 0
    chance = 0.0 if heavy_unmodelled else slo_chance(pool, now, priority, wait_s, work)
    if chance >= settings.good_chance:
        return (0.0, float(other), pool.cost_per_request() if other else 0.0, _balance_load(pool, now))
    return (1.0, -chance, float(other), _balance_load(pool, now))


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


def _should_shed(shape: Shape, ordered: list[PoolState], now: float, settings: RouterSettings, tiers: Mapping[str, TierSlo]) -> bool:
    slo = tiers.get(shape.tier)
    if slo is None or slo.priority < settings.shed_priority:
        return False
    return all(p.load_fraction(now) >= settings.shed_load_fraction for p in ordered)


def pick_replica(
    shape: Shape,
    model: str,
    replicas: Sequence[ReplicaState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
) -> ReplicaState | None:
    live = [r for r in replicas if r.name not in exclude and r.serves(model) and r.routable(now)]
    if not live:
        return None
    if len(live) == 1:
        return live[0]
    if shape.prefix_fp:
        bound = settings.affinity_slack * (sum(r.num_in_flight + r.foreign_requests for r in live) / len(live) + 1.0)
        ranked = sorted(live, key=lambda r: _mix64(shape.prefix_fp ^ r.affinity_salt), reverse=True)
        for replica in ranked:
            if replica.num_in_flight + replica.foreign_requests < bound:
                return replica
    # A foreign request's length is unknown: each is taken to be as long as this one.
    size = shape.prompt_tokens + shape.predicted_output_p50
    return min(live, key=lambda r: (r.outstanding_tokens + r.foreign_requests * size, r.num_in_flight + r.foreign_requests))


def foreign_requests(engine: EngineLoad, own_in_flight: int) -> int:
    """Requests an engine reports (running and waiting) beyond the ``own_in_flight`` this gateway has
    there as the report arrives: the load someone else put on it. Stored on the replica at each
    scrape, so own requests sent after it count once, through the gateway's own books."""
    return max(0, engine.num_requests - own_in_flight)


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a well-spread, process-independent rank for rendezvous hashing."""
    z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
