"""Decide: allocate each GPU kind's budget among pools to maximise tier-weighted goodput.

A pool option runs one engine configuration on one GPU kind and serves one or more traffic shapes
(a generated ``<shape>@<gpu>`` pool serves one; a pool the operator declared serves the shapes it was
declared for). One replica uses ``gpus_per_replica`` GPUs and serves ``rate[p, s]`` of shape ``s``
within the SLO when it serves that shape alone (from the capacity model); serving several it
time-shares, each request of ``s`` taking ``1 / rate[p, s]`` of a replica-second. For demand
``d[s, w]`` of shape ``s`` in window ``w`` (one window for a live plan, every window of a run for the
best fixed partition in hindsight), the mixed-integer program is::

    max  sum_w omega_w sum_{p, s} weight_s g[p, s, w]  -  sum_p move_cost_p |n_p - current_p|  +  eps t
    s.t. sum_s g[p, s, w] / rate[p, s] <= n_p;  sum_p g[p, s, w] <= d[s, w];  sum_{p on kind k} gpus_p n_p <= budget_k
         t <= sum_{p serving s} rate[p, s] n_p / D_s for every shape with demand (D_s: its weighted demand), t <= 10
         min_p <= n_p <= max_p integer,  g >= 0

With one shape per pool the time-sharing row is today's ``g[p, w] <= rate_p n_p``. ``move_cost_p``
charges a replica change the goodput it loses while it drains and restarts, spread over the horizon
the plan is expected to hold, so a small predicted gain does not pay for a move. ``t`` is the smallest
capacity-to-demand ratio over shapes: with a tiny weight it only breaks ties, spreading GPUs that add
no predicted goodput in proportion to demand (headroom), instead of arbitrarily. Solved with scipy's
HiGHS ``milp``; ``brute_force`` enumerates small instances for the tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

MAX_HEADROOM = 10.0
HEADROOM_WEIGHT = 1e-3  # per unit of headroom, relative to one weighted request/s


@dataclass(frozen=True, slots=True)
class ShapeRate:
    """One shape a pool option serves: one replica's rate for it alone (> 0) and the tier-weighted value
    of one of its good requests."""

    shape: str
    rate_per_replica_rps: float
    weight: float


@dataclass(frozen=True, slots=True)
class PoolOption:
    name: str
    gpu: str
    gpus_per_replica: int
    serves: tuple[ShapeRate, ...]  # empty: a declared pool none of whose shapes has load (it may keep its GPUs)
    min_replicas: int = 0
    max_replicas: int | None = None

    @classmethod
    def one(cls, name: str, gpu: str, shape: str, gpus_per_replica: int, rate_per_replica_rps: float, weight: float,
            min_replicas: int = 0, max_replicas: int | None = None) -> PoolOption:
        """An option that serves one shape (a generated ``<shape>@<gpu>`` pool)."""
        return cls(name, gpu, gpus_per_replica, (ShapeRate(shape, rate_per_replica_rps, weight),), min_replicas, max_replicas)


@dataclass(frozen=True, slots=True)
class PlanProblem:
    pools: tuple[PoolOption, ...]
    gpu_to_budget: tuple[tuple[str, int], ...]
    window_demands: tuple[tuple[tuple[str, float], ...], ...]  # per window: (shape, rate_rps) pairs
    window_weights: tuple[float, ...]
    current: tuple[tuple[str, int], ...] = ()  # pool -> replicas now (absent: 0)
    move_cost: tuple[tuple[str, float], ...] = ()  # pool -> objective units lost per replica changed


@dataclass(frozen=True, slots=True)
class Plan:
    pool_to_num_replicas: tuple[tuple[str, int], ...]
    predicted_goodput_rps: float  # unweighted, averaged over the windows
    objective: float

    def replicas(self) -> dict[str, int]:
        return dict(self.pool_to_num_replicas)


def _shape_totals(problem: PlanProblem) -> dict[str, float]:
    totals: dict[str, float] = {}
    for demand, omega in zip(problem.window_demands, problem.window_weights, strict=True):
        for shape, rate in demand:
            totals[shape] = totals.get(shape, 0.0) + omega * rate
    return {s: d for s, d in totals.items() if d > 0}


def _capacities(pools: Sequence[PoolOption], pool_to_num: Mapping[str, int]) -> dict[str, float]:
    """Per shape: the rate its pools would serve if each served it alone (what headroom is measured in)."""
    shape_to_capacity: dict[str, float] = {}
    for pool in pools:
        for served in pool.serves:
            shape_to_capacity[served.shape] = shape_to_capacity.get(served.shape, 0.0) + served.rate_per_replica_rps * pool_to_num.get(pool.name, 0)
    return shape_to_capacity


def _solve(problem: PlanProblem, fixed: Mapping[str, int] | None = None) -> tuple[np.ndarray, list[tuple[int, ShapeRate]]] | None:
    """The program's solution vector and its (pool index, shape) pairs of ``g``; with ``fixed``, the
    replica counts are given and only the routing split is chosen (an LP)."""
    pools, num_p, num_w = problem.pools, len(problem.pools), len(problem.window_demands)
    pairs = [(p, served) for p, pool in enumerate(pools) for served in pool.serves]
    current, move_cost = dict(problem.current), dict(problem.move_cost)
    totals = _shape_totals(problem)
    num_vars = num_p + len(pairs) * num_w + num_p + 1  # n, g, u, t
    g0, u0, t_index = num_p, num_p + len(pairs) * num_w, num_vars - 1
    c = np.zeros(num_vars)
    for k, (_, served) in enumerate(pairs):
        for w, omega in enumerate(problem.window_weights):
            c[g0 + k * num_w + w] = -omega * served.weight
    for p, pool in enumerate(pools):
        c[u0 + p] = move_cost.get(pool.name, 0.0)
    c[t_index] = -HEADROOM_WEIGHT
    rows: list[np.ndarray] = []
    upper: list[float] = []

    def constrain(row: np.ndarray, bound: float) -> None:  # one row of A_ub x <= b_ub
        rows.append(row)
        upper.append(bound)

    for p, pool in enumerate(pools):
        mine = [k for k, (q, _) in enumerate(pairs) if q == p]
        # sum_s g / rate_s <= n, scaled by the largest rate (one shape: g <= rate n, as ever)
        scale = max((pairs[k][1].rate_per_replica_rps for k in mine), default=1.0)
        for w in range(num_w):
            row = np.zeros(num_vars)
            for k in mine:
                row[g0 + k * num_w + w] = scale / pairs[k][1].rate_per_replica_rps
            row[p] = -scale
            constrain(row, 0.0)
        for sign in (1.0, -1.0):  # u_p >= |n_p - current_p|
            row = np.zeros(num_vars)
            row[p], row[u0 + p] = sign, -1.0
            constrain(row, sign * current.get(pool.name, 0))
    shapes = sorted({served.shape for _, served in pairs})
    for w, demand in enumerate(problem.window_demands):
        shape_to_rate = dict(demand)
        for shape in shapes:
            row = np.zeros(num_vars)
            for k, (_, served) in enumerate(pairs):
                if served.shape == shape:
                    row[g0 + k * num_w + w] = 1.0
            constrain(row, shape_to_rate.get(shape, 0.0))
    for shape, total in totals.items():
        row = np.zeros(num_vars)
        row[t_index] = 1.0
        for p, served in pairs:
            if served.shape == shape:
                row[p] -= served.rate_per_replica_rps / total
        constrain(row, 0.0)
    for gpu, num_gpus in problem.gpu_to_budget:
        row = np.zeros(num_vars)
        for p, pool in enumerate(pools):
            if pool.gpu == gpu:
                row[p] = pool.gpus_per_replica
        constrain(row, num_gpus)
    lower_b = np.zeros(num_vars)
    upper_b = np.full(num_vars, np.inf)
    budget = dict(problem.gpu_to_budget)
    for p, pool in enumerate(pools):
        if fixed is not None:
            lower_b[p] = upper_b[p] = fixed.get(pool.name, 0)
            continue
        lower_b[p] = pool.min_replicas
        cap = budget.get(pool.gpu, 0) // pool.gpus_per_replica
        upper_b[p] = min(cap, pool.max_replicas) if pool.max_replicas is not None else cap
    upper_b[t_index] = MAX_HEADROOM if totals else 0.0
    integrality = np.zeros(num_vars)
    integrality[:num_p] = 1
    result = milp(
        c, constraints=LinearConstraint(np.array(rows), -np.inf, np.array(upper)),
        integrality=integrality, bounds=Bounds(lower_b, upper_b),
    )
    if not result.success:
        return None
    return result.x, pairs


def plan(problem: PlanProblem) -> Plan | None:
    """The optimal allocation, or None when no allocation satisfies the budgets and minimums."""
    if not problem.pools:
        return Plan((), 0.0, 0.0)
    found = _solve(problem)
    if found is None:
        return None
    x, _ = found
    counts = tuple((pool.name, int(round(x[p]))) for p, pool in enumerate(problem.pools))
    return evaluate(problem, dict(counts))


def evaluate(problem: PlanProblem, pool_to_num: Mapping[str, int]) -> Plan:
    """Objective and predicted goodput of one allocation. With one shape per pool the optimal routing
    split is closed form (a shape's goodput is min(demand, its pools' capacity)); a pool that
    time-shares shapes needs the routing LP."""
    current, move_cost = dict(problem.current), dict(problem.move_cost)
    totals = _shape_totals(problem)
    shape_to_capacity = _capacities(problem.pools, pool_to_num)
    total_weight = sum(problem.window_weights) or 1.0
    moved = sum(move_cost.get(p.name, 0.0) * abs(pool_to_num.get(p.name, 0) - current.get(p.name, 0)) for p in problem.pools)
    headroom = HEADROOM_WEIGHT * min(MAX_HEADROOM, min(shape_to_capacity.get(s, 0.0) / d for s, d in totals.items())) if totals else 0.0
    objective, goodput = 0.0, 0.0
    if all(len(p.serves) <= 1 for p in problem.pools):
        shape_to_weight = {served.shape: served.weight for p in problem.pools for served in p.serves}
        for demand, omega in zip(problem.window_demands, problem.window_weights, strict=True):
            for shape, rate in demand:
                served_rps = min(rate, shape_to_capacity.get(shape, 0.0))
                objective += omega * shape_to_weight.get(shape, 0.0) * served_rps
                goodput += omega * served_rps
    else:
        found = _solve(problem, pool_to_num)
        assert found is not None, "a routing split always exists (g = 0)"
        x, pairs = (found[0].tolist(), found[1])  # Python floats: plans go into JSON decision records
        num_w, g0 = len(problem.window_demands), len(problem.pools)
        for k, (_, served) in enumerate(pairs):
            for w, omega in enumerate(problem.window_weights):
                objective += omega * served.weight * x[g0 + k * num_w + w]
                goodput += omega * x[g0 + k * num_w + w]
    return Plan(tuple(sorted(pool_to_num.items())), goodput / total_weight, objective - moved + headroom)


def allows(problem: PlanProblem, pool_to_num: Mapping[str, int]) -> bool:
    """Whether ``pool_to_num`` is an allocation of ``problem``: its pools only, within their bounds and the budgets."""
    bounds = {p.name: p for p in problem.pools}
    if not pool_to_num.keys() <= bounds.keys():
        return False
    used: dict[str, int] = {}
    for pool in problem.pools:
        n = pool_to_num.get(pool.name, 0)
        if n < pool.min_replicas or (pool.max_replicas is not None and n > pool.max_replicas):
            return False
        used[pool.gpu] = used.get(pool.gpu, 0) + n * pool.gpus_per_replica
    budget = dict(problem.gpu_to_budget)
    return all(n <= budget.get(gpu, 0) for gpu, n in used.items())


def brute_force(problem: PlanProblem) -> Plan | None:
    """Enumerate every allocation (small instances only): the reference the tests hold ``plan`` to."""
    budget = dict(problem.gpu_to_budget)
    ranges: list[Sequence[int]] = []
    for pool in problem.pools:
        cap = budget.get(pool.gpu, 0) // pool.gpus_per_replica
        high = min(cap, pool.max_replicas) if pool.max_replicas is not None else cap
        ranges.append(range(pool.min_replicas, high + 1))
    best: Plan | None = None
    for counts in itertools.product(*ranges):
        pool_to_num = {p.name: n for p, n in zip(problem.pools, counts, strict=True)}
        if not allows(problem, pool_to_num):
            continue
        candidate = evaluate(problem, pool_to_num)
        if best is None or candidate.objective > best.objective + 1e-9:
            best = candidate
    return best


def fill_budget(problem: PlanProblem, found: Plan) -> Plan:
    """``found`` with every GPU it leaves idle given to a pool: back to a pool it shrank (no move),
    else to the pool of that GPU kind one of whose shapes has the least capacity per unit of demand.

    The objective caps headroom (MAX_HEADROOM), so an optimum may leave GPUs unallocated once every
    shape has ample capacity; an idle GPU still serves nobody, so the deployed plan fills them. The
    predicted goodput never drops (capacity only grows)."""
    counts = found.replicas()
    current, totals = dict(problem.current), _shape_totals(problem)
    shape_to_capacity = _capacities(problem.pools, counts)

    def starved(pool: PoolOption) -> float:  # capacity per unit of demand of its neediest shape
        return min((shape_to_capacity.get(s.shape, 0.0) / totals[s.shape] for s in pool.serves if s.shape in totals), default=float("inf"))

    for gpu, budget in problem.gpu_to_budget:
        mine = [p for p in problem.pools if p.gpu == gpu]
        left = budget - sum(p.gpus_per_replica * counts.get(p.name, 0) for p in mine)
        while True:
            fits = [p for p in mine if p.gpus_per_replica <= left and (p.max_replicas is None or counts.get(p.name, 0) < p.max_replicas)]
            if not fits:
                break
            back = [p for p in fits if counts.get(p.name, 0) < current.get(p.name, 0)]
            pick = back[0] if back else min(fits, key=lambda p: (starved(p), p.name))
            counts[pick.name] = counts.get(pick.name, 0) + 1
            for served in pick.serves:
                shape_to_capacity[served.shape] = shape_to_capacity.get(served.shape, 0.0) + served.rate_per_replica_rps
            left -= pick.gpus_per_replica
    return evaluate(problem, counts)
