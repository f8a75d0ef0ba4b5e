"""Decide: allocate each GPU kind's budget among pools to maximise tier-weighted goodput.

A pool option serves one traffic shape on one GPU kind with one compiled engine configuration; one
replica of it uses ``gpus_per_replica`` GPUs and serves ``rate_per_replica_rps`` of its shape within
the SLO (from the capacity model). For demand ``d[s, w]`` of shape ``s`` in window ``w`` (one window
for a live plan, every window of a run for the best fixed partition in hindsight), the mixed-integer
program is::

    max  sum_w omega_w sum_p weight_s(p) g[p, w]  -  sum_p move_cost_p |n_p - current_p|  +  eps t
    s.t. g[p, w] <= rate_p n_p;  sum_{p of s} g[p, w] <= d[s, w];  sum_{p on kind k} gpus_p n_p <= budget_k
         t <= sum_{p of s} rate_p n_p / D_s for every shape with demand (D_s: its weighted demand), t <= 10
         min_p <= n_p <= max_p integer,  g >= 0

``move_cost_p`` charges a replica change the goodput it loses while it drains and restarts, spread over
the horizon the plan is expected to hold, so a small predicted gain does not pay for a move. ``t`` is
the smallest capacity-to-demand ratio over shapes: with a tiny weight it only breaks ties, spreading
GPUs that add no predicted goodput in proportion to demand (headroom), instead of arbitrarily.
Solved with scipy's HiGHS ``milp``; ``brute_force`` enumerates small instances for the tests.
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
class PoolOption:
    name: str
    gpu: str
    shape: str
    gpus_per_replica: int
    rate_per_replica_rps: float
    weight: float  # tier-weighted value of one good request of its shape
    min_replicas: int = 0
    max_replicas: int | None = None


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


def single_window(demand: Mapping[str, float]) -> tuple[tuple[tuple[str, float], ...], ...]:
    return (tuple(sorted(demand.items())),)


def _shape_totals(problem: PlanProblem) -> dict[str, float]:
    totals: dict[str, float] = {}
    for demand, omega in zip(problem.window_demands, problem.window_weights, strict=True):
        for shape, rate in demand:
            totals[shape] = totals.get(shape, 0.0) + omega * rate
    return {s: d for s, d in totals.items() if d > 0}


def plan(problem: PlanProblem) -> Plan | None:
    """The optimal allocation, or None when no allocation satisfies the budgets and minimums."""
    pools, num_p, num_w = problem.pools, len(problem.pools), len(problem.window_demands)
    if num_p == 0:
        return Plan((), 0.0, 0.0)
    current, move_cost = dict(problem.current), dict(problem.move_cost)
    totals = _shape_totals(problem)
    num_vars = num_p + num_p * num_w + num_p + 1  # n, g, u, t
    g0, u0, t_index = num_p, num_p + num_p * num_w, num_vars - 1
    c = np.zeros(num_vars)
    for p, pool in enumerate(pools):
        for w, omega in enumerate(problem.window_weights):
            c[g0 + p * num_w + w] = -omega * pool.weight
        c[u0 + p] = move_cost.get(pool.name, 0.0)
    c[t_index] = -HEADROOM_WEIGHT
    rows: list[np.ndarray] = []
    upper: list[float] = []

    def constrain(row: np.ndarray, bound: float) -> None:  # one row of A_ub x <= b_ub
        rows.append(row)
        upper.append(bound)

    for p, pool in enumerate(pools):
        for w in range(num_w):
            row = np.zeros(num_vars)
            row[g0 + p * num_w + w], row[p] = 1.0, -pool.rate_per_replica_rps
            constrain(row, 0.0)
        for sign in (1.0, -1.0):  # u_p >= |n_p - current_p|
            row = np.zeros(num_vars)
            row[p], row[u0 + p] = sign, -1.0
            constrain(row, sign * current.get(pool.name, 0))
    shapes = sorted({pool.shape for pool in pools})
    for w, demand in enumerate(problem.window_demands):
        shape_to_rate = dict(demand)
        for shape in shapes:
            row = np.zeros(num_vars)
            for p, pool in enumerate(pools):
                if pool.shape == shape:
                    row[g0 + p * num_w + w] = 1.0
            constrain(row, shape_to_rate.get(shape, 0.0))
    for shape, total in totals.items():
        row = np.zeros(num_vars)
        row[t_index] = 1.0
        for p, pool in enumerate(pools):
            if pool.shape == shape:
                row[p] = -pool.rate_per_replica_rps / total
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
    counts = tuple((pool.name, int(round(result.x[p]))) for p, pool in enumerate(pools))
    return evaluate(problem, dict(counts))


def evaluate(problem: PlanProblem, pool_to_num: Mapping[str, int]) -> Plan:
    """Objective and predicted goodput of one allocation (the optimal routing split is closed form:
    each pool serves one shape, so a shape's goodput is min(demand, its pools' capacity))."""
    current, move_cost = dict(problem.current), dict(problem.move_cost)
    totals = _shape_totals(problem)
    shape_to_capacity: dict[str, float] = {}
    shape_to_weight: dict[str, float] = {}
    for pool in problem.pools:
        shape_to_capacity[pool.shape] = shape_to_capacity.get(pool.shape, 0.0) + pool.rate_per_replica_rps * pool_to_num.get(pool.name, 0)
        shape_to_weight[pool.shape] = pool.weight
    objective, goodput = 0.0, 0.0
    for demand, omega in zip(problem.window_demands, problem.window_weights, strict=True):
        for shape, rate in demand:
            served = min(rate, shape_to_capacity.get(shape, 0.0))
            objective += omega * shape_to_weight.get(shape, 0.0) * served
            goodput += omega * served
    objective -= sum(move_cost.get(p.name, 0.0) * abs(pool_to_num.get(p.name, 0) - current.get(p.name, 0)) for p in problem.pools)
    if totals:
        headroom = min(shape_to_capacity.get(s, 0.0) / d for s, d in totals.items())
        objective += HEADROOM_WEIGHT * min(MAX_HEADROOM, headroom)
    total_weight = sum(problem.window_weights) or 1.0
    return Plan(tuple(sorted(pool_to_num.items())), goodput / total_weight, objective)


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
        used: dict[str, int] = {}
        for pool, n in zip(problem.pools, counts, strict=True):
            used[pool.gpu] = used.get(pool.gpu, 0) + n * pool.gpus_per_replica
        if any(n > budget.get(gpu, 0) for gpu, n in used.items()):
            continue
        candidate = evaluate(problem, {p.name: n for p, n in zip(problem.pools, counts, strict=True)})
        if best is None or candidate.objective > best.objective + 1e-9:
            best = candidate
    return best


def fill_budget(problem: PlanProblem, found: Plan) -> Plan:
    """``found`` with every GPU it leaves idle given to a pool: back to a pool it shrank (no move),
    else to the pool of that GPU kind whose shape has the least capacity per unit of demand.

    The objective caps headroom (MAX_HEADROOM), so an optimum may leave GPUs unallocated once every
    shape has ample capacity; an idle GPU still serves nobody, so the deployed plan fills them. The
    predicted goodput never drops (capacity only grows)."""
    counts = found.replicas()
    current, totals = dict(problem.current), _shape_totals(problem)
    shape_to_capacity: dict[str, float] = {}
    for pool in problem.pools:
        shape_to_capacity[pool.shape] = shape_to_capacity.get(pool.shape, 0.0) + pool.rate_per_replica_rps * counts.get(pool.name, 0)
    for gpu, budget in problem.gpu_to_budget:
        mine = [p for p in problem.pools if p.gpu == gpu]
        left = budget - sum(p.gpus_per_replica * counts.get(p.name, 0) for p in mine)
        while True:
            fits = [p for p in mine if p.gpus_per_replica <= left and (p.max_replicas is None or counts.get(p.name, 0) < p.max_replicas)]
            if not fits:
                break
            back = [p for p in fits if counts.get(p.name, 0) < current.get(p.name, 0)]
            pick = back[0] if back else min(fits, key=lambda p: (
                shape_to_capacity.get(p.shape, 0.0) / totals[p.shape] if p.shape in totals else float("inf"), p.name))
            counts[pick.name] = counts.get(pick.name, 0) + 1
            shape_to_capacity[pick.shape] = shape_to_capacity.get(pick.shape, 0.0) + pick.rate_per_replica_rps
            left -= pick.gpus_per_replica
    return evaluate(problem, counts)
