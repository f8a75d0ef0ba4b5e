"""One virtual replica: a kernels.engine.Engine stepped on the simulator's clock.

An arrival that lands in the middle of a fast-forwarded decode stretch cuts the stretch at the first
step boundary at or after the arrival (``Engine.cut``), so the newcomer joins the batch when a real
engine would let it in, while quiet replicas still jump from completion to completion in one plan.
"""

from __future__ import annotations

from fleet.pool import ReplicaState
from kernels.engine import Engine
from kernels.engine_types import EngineRequest, IterationPlan, StepOutputs
from kernels.perf import PerfModel

_LONG_HORIZON_S = 3600.0


class VirtualReplica:
    """Engine + the router's view of it (``state``) + when its start-up completes."""

    __slots__ = ("engine", "perf", "plan", "plan_seq", "pool", "ready_at", "req_to_domain", "slot", "state")

    def __init__(self, slot: str, pool: str, perf: PerfModel, state: ReplicaState, ready_at: float) -> None:
        self.slot = slot
        self.pool = pool
        self.perf = perf
        self.engine = Engine(perf, perf.config)
        self.state = state
        self.ready_at = ready_at
        self.plan: IterationPlan | None = None
        self.plan_seq = 0  # bumps when the in-flight plan is replaced, so stale end events are ignored
        self.req_to_domain: dict[str, str] = {}

    def add(self, req: EngineRequest, now: float) -> bool:
        if not self.engine.add_request(req, now):
            return False
        self.req_to_domain[req.req_id] = req.domain
        return True

    def next_plan(self, now: float) -> IterationPlan | None:
        """Schedule the next iteration if the engine is idle; returns the plan to time (None: nothing new)."""
        if self.plan is not None:
            return None
        self.plan = self.engine.schedule(now, horizon_s=_LONG_HORIZON_S)
        self.plan_seq += 1
        return self.plan

    def cut_for_arrival(self, now: float) -> IterationPlan | None:
        """Shorten a fast-forwarded plan so the new arrival joins at the next step; the new plan or None."""
        plan = self.plan
        if plan is None or plan.num_steps <= 1 or plan.ended_at <= now:
            return None
        cut = self.engine.cut(plan, now)
        if cut is plan:
            return None
        self.plan = cut
        self.plan_seq += 1
        return cut

    def finish_plan(self, now: float) -> StepOutputs:
        plan = self.plan
        assert plan is not None
        self.plan = None
        outputs = self.engine.update(plan, now)
        for req_id in outputs.finished_req_ids:
            del self.req_to_domain[req_id]
        return outputs

    @property
    def num_in_flight(self) -> int:
        return len(self.req_to_domain)
