"""The controller adopts the operator's declared pools: options that serve several shapes (the planner's
time-sharing), declared pools kept while they fit the mix, ``<shape>@<gpu>`` pools only for a shape no
declared pool serves, and the live gateway keeping its declared pools under a mix they fit."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision
from fleet.evidence import PlanEvidence
from fleet.options import DeclaredPool, config_json
from fleet.planner import PlanProblem, PoolOption, ShapeRate, brute_force, evaluate, plan
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from kernels.config import EngineConfig
from tests.fleet.test_controller_sim import TableCapacity
from tests.fleet.test_planner_rollout import FakeActuator, tick
from tests.gateway.test_live_fleet import ADMIN, KEY, _admin, _traffic
from tests.support.procs import start_gateway, write_tenant

H100, H200 = "H100-SXM", "H200"
CHAT_CONFIG = EngineConfig(max_running_requests=256, chunked_prefill_size=2048)
LONG_CONFIG = EngineConfig(max_running_requests=64, chunked_prefill_size=8192)
# as the gateway's slots carry a declared pool's engine (orjson, sorted, no spaces): not config_json's spelling
CHAT_JSON = '{"chunked_prefill_size":2048,"max_running_requests":256,"tp":1}'
LONG_JSON = '{"chunked_prefill_size":8192,"max_running_requests":64,"tp":1}'
CHAT = DeclaredPool("chat-h100", H100, ("short-chat", "batch"), CHAT_CONFIG, CHAT_JSON)
LONG = DeclaredPool("long-h200", H200, ("long-context", "reasoning"), LONG_CONFIG, LONG_JSON)


# -- the planner -------------------------------------------------------------------------------


def _two_shape_problem(rng: random.Random) -> PlanProblem:
    weight = {s: rng.choice([1.0, 2.0, 4.0]) for s in "abc"}
    shared = PoolOption("ab", "H100", 1, (ShapeRate("a", rng.uniform(2, 10), weight["a"]), ShapeRate("b", rng.uniform(1, 5), weight["b"])))
    pools = (shared, PoolOption.one("b@H100", "H100", "b", rng.choice([1, 2]), rng.uniform(1, 8), weight["b"]),
             PoolOption.one("c@H200", "H200", "c", 1, rng.uniform(1, 8), weight["c"]),
             PoolOption.one("a@H200", "H200", "a", 1, rng.uniform(1, 8), weight["a"]))
    windows = (tuple((s, rng.uniform(0, 20)) for s in "ab"), tuple((s, rng.uniform(0, 20)) for s in "abc"))
    return PlanProblem(pools, (("H100", rng.randint(1, 4)), ("H200", rng.randint(1, 3))), windows, (0.5, 0.5),
                       current=tuple((p.name, rng.randint(0, 1)) for p in pools), move_cost=tuple((p.name, rng.uniform(0, 2)) for p in pools))


def test_milp_with_a_two_shape_option_matches_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(12):
        problem = _two_shape_problem(rng)
        fast, slow = plan(problem), brute_force(problem)
        assert fast is not None and slow is not None
        assert abs(fast.objective - slow.objective) < 1e-6, (fast, slow)


def test_a_replica_time_shares_its_shapes() -> None:
    shared = PoolOption("ab", "G", 1, (ShapeRate("a", 10.0, 1.0), ShapeRate("b", 5.0, 1.0)))
    fits = PlanProblem((shared,), (("G", 1),), ((("a", 5.0), ("b", 2.5)),), (1.0,))
    assert evaluate(fits, {"ab": 1}).predicted_goodput_rps == 7.5  # 5/10 + 2.5/5 = one replica-second a second
    over = PlanProblem((shared,), (("G", 1),), ((("a", 10.0), ("b", 5.0)),), (1.0,))
    found = plan(over)
    assert found is not None and found.replicas() == {"ab": 1}
    assert abs(found.predicted_goodput_rps - 10.0) < 1e-6  # a is cheaper per replica-second: served first
    assert abs(plan(PlanProblem((shared,), (("G", 2),), over.window_demands, (1.0,))).predicted_goodput_rps - 15.0) < 1e-6  # type: ignore[union-attr]


def test_a_shape_without_demand_changes_nothing_and_one_shape_plans_are_unchanged() -> None:
    rng = random.Random(3)
    for _ in range(10):
        rates = {s: rng.uniform(1, 10) for s in "ab"}
        demand = ((("a", rng.uniform(0, 30)), ("b", rng.uniform(0, 30))),)
        alone = (PoolOption.one("a@G", "G", "a", 1, rates["a"], 1.0), PoolOption.one("b@G", "G", "b", 1, rates["b"], 2.0))
        # the same options, the first also able to serve a shape nobody sends (the LP path, not the closed form)
        idle = (PoolOption("a@G", "G", 1, (ShapeRate("a", rates["a"], 1.0), ShapeRate("z", 3.0, 1.0))), alone[1])
        current = (("a@G", rng.randint(0, 2)), ("b@G", rng.randint(0, 2)))
        one, shared = (PlanProblem(pools, (("G", 4),), demand, (1.0,), current, (("a@G", 0.3), ("b@G", 0.3))) for pools in (alone, idle))
        found, again = plan(one), plan(shared)
        assert found is not None and again is not None and found.replicas() == again.replicas()
        assert abs(found.objective - again.objective) < 1e-6 and abs(found.predicted_goodput_rps - again.predicted_goodput_rps) < 1e-6


# -- the controller, in virtual time -----------------------------------------------------------


def _feed(tel: Telemetry, start: float, end: float, shape_to_rps: dict[str, float]) -> None:
    """Requests of each shape at its rate, in time order (the telemetry is a ring of buckets), all on time."""
    arrivals = sorted((start + k / rate, shape) for shape, rate in shape_to_rps.items() for k in range(int((end - start) * rate)))
    for at, shape in arrivals:
        tel.record_arrival(at, shape, "standard", 6000 if shape == "long-context" else 800)
        tel.record_outcome(at, shape, "any", True, 200)


def _run(controller: Controller, actuator: FakeActuator, slots: list[SlotState], start: int, end: int) -> tuple[list[Decision], list[SlotState]]:
    """Tick every 5 s; a slot an activate put into a pool serves there from the next tick on."""
    decisions: list[Decision] = []
    for now in range(start, end, 5):
        decisions += tick(controller, actuator, float(now), slots)
        slots = [SlotState(s.slot, pool, s.gpu, config) for s in slots for pool, config in [actuator.slot_to_pool.get(s.slot, (s.pool, s.config_json))]]
    return decisions, slots


def _slots(pool: DeclaredPool, num: int) -> list[SlotState]:
    return [SlotState(f"{pool.gpu}/{k}", pool.name, pool.gpu, pool.config_json) for k in range(num)]


CAPACITY = TableCapacity({"short-chat": 5.0, "long-context": 1.0, "reasoning": 1.0, "batch": 2.0})


def test_a_stationary_mix_the_declared_pools_fit_keeps_every_replica_where_it_was_declared() -> None:
    tel = Telemetry()
    settings = ControllerSettings("llama-3.1-8b", {H100: 2, H200: 2}, declared=(CHAT, LONG))
    controller = Controller(settings, tel, CAPACITY, tel.window(0.0))  # as live: no reference mix yet
    slots = _slots(CHAT, 2) + _slots(LONG, 2)
    _feed(tel, 0.0, 600.0, {"short-chat": 4.0, "long-context": 0.8, "batch": 0.5})
    decisions, after = _run(controller, FakeActuator({}, restart_s=30.0), slots, 5, 600)
    plans = [d.evidence for d in decisions if isinstance(d.evidence, PlanEvidence)]
    assert plans and all(p.outcome == "keep" and p.num_moves == 0 for p in plans), decisions
    assert {"step", "recompile"}.isdisjoint(d.kind for d in decisions)
    assert after == slots
    configs = plans[0].configs
    assert configs is not None and (configs["chat-h100"], configs["long-h200"]) == (CHAT_JSON, LONG_JSON)  # as declared: nothing restarts
    # the shapes each declared pool covers get no pool of their own on its GPU kind; the uncovered pairs do
    assert set(configs) == {"chat-h100", "long-h200", "short-chat@H200", "batch@H200", "long-context@H100-SXM"}
    assert controller.options is not None and [s.shape for s in controller.options.pools[0].serves] == ["batch", "short-chat"]


def test_a_declared_pool_keeps_the_configuration_its_replicas_run_when_it_is_not_the_declared_one() -> None:
    # an operator's canary adopted prompt caching off for the chat pool: its replicas run that, spelled as the
    # operator's JSON is; a plan that went back to the declared configuration would restart them to undo it
    adopted = '{"chunked_prefill_size":2048,"enable_prefix_caching":false,"max_running_requests":256,"tp":1}'
    tel = Telemetry()
    settings = ControllerSettings("llama-3.1-8b", {H100: 2, H200: 2}, declared=(CHAT, LONG))
    controller = Controller(settings, tel, CAPACITY, tel.window(0.0))
    slots = [SlotState(s.slot, s.pool, s.gpu, adopted) for s in _slots(CHAT, 2)] + _slots(LONG, 2)
    _feed(tel, 0.0, 600.0, {"short-chat": 4.0, "long-context": 0.8, "batch": 0.5})
    decisions, after = _run(controller, FakeActuator({}, restart_s=30.0), slots, 5, 600)
    plans = [d.evidence for d in decisions if isinstance(d.evidence, PlanEvidence)]
    assert plans and all(p.outcome == "keep" and p.num_moves == 0 for p in plans), decisions
    assert {"step", "recompile"}.isdisjoint(d.kind for d in decisions) and after == slots
    configs = plans[0].configs
    assert configs is not None and json.loads(configs["chat-h100"]) == {"chunked_prefill_size": 2048, "enable_prefix_caching": False,
                                                                       "max_running_requests": 256}


def test_a_shape_no_declared_pool_serves_gets_a_pool_of_its_own_and_replicas_move_there() -> None:
    tel = Telemetry()
    chat_only = DeclaredPool("chat-h100", H100, ("short-chat",), CHAT_CONFIG, CHAT_JSON)
    settings = ControllerSettings("llama-3.1-8b", {H100: 3}, declared=(chat_only,), verify_after_s=30.0)
    controller = Controller(settings, tel, CAPACITY, tel.window(0.0))
    actuator = FakeActuator({}, restart_s=30.0)
    slots = _slots(chat_only, 3)
    _feed(tel, 0.0, 300.0, {"short-chat": 6.0})
    before, slots = _run(controller, actuator, slots, 5, 300)
    # the drift plan, then its refine once the window holds only the new mix: both keep the declared pool
    assert [d.kind for d in before] == ["drift", "plan", "plan"] and before[1].evidence == PlanEvidence(
        outcome="keep", diff={}, budget={H100: 3}, predicted_goodput_before_rps=6.0, predicted_goodput_after_rps=6.0,
        objective_before=before[1].evidence.objective_before, objective_after=before[1].evidence.objective_after,  # type: ignore[union-attr]
        configs={"chat-h100": CHAT_JSON}, num_moves=0)
    assert before[2].evidence.trigger == "refine" and before[2].evidence.outcome == "keep"  # type: ignore[union-attr]
    _feed(tel, 300.0, 700.0, {"short-chat": 6.0, "long-context": 1.0})  # long prompts arrive: no declared pool serves them
    after, slots = _run(controller, actuator, slots, 300, 700)
    kinds = [d.kind for d in after]
    assert kinds[:3] == ["drift", "plan", "step"], kinds
    planned = after[1].evidence
    assert isinstance(planned, PlanEvidence) and planned.outcome == "apply"
    assert planned.diff == {"chat-h100": (3, 2), "long-context@H100-SXM": (0, 1)}
    assert planned.configs is not None and planned.configs["chat-h100"] == CHAT_JSON
    assert planned.configs["long-context@H100-SXM"] == config_json(EngineConfig())
    assert [(m.from_pool, m.to_pool) for m in after[2].moves] == [("chat-h100", "long-context@H100-SXM")]
    assert sorted(s.pool for s in slots) == ["chat-h100", "chat-h100", "long-context@H100-SXM"]


# -- live: the gateway's embedded controller -----------------------------------------------------


def _declared_pools(url: str) -> dict[str, list[str]]:
    state = _admin(url, "/admin/state")
    return {p["name"]: sorted(r["url"] for r in p["replicas"]) for p in state["pools"]}  # type: ignore[index,union-attr]


def test_live_controller_keeps_the_declared_pools_under_a_mix_they_fit(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "live", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    pool = {"model": "llama-3.1-8b", "replicas": {"emulated": 1}}
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [{**pool, "name": "chat-h100", "gpu": H100, "shapes": ["short-chat", "batch"]},
                      {**pool, "name": "long-h200", "gpu": H200, "shapes": ["long-context", "reasoning"], "engine": {"chunked_prefill_size": 8192}}],
            "emulator_speed": 20.0,
            "controller": {"enabled": True, "tick_s": 5.0, "decision_log": "decisions.jsonl"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    try:
        before = _declared_pools(gateway.url)
        statuses = asyncio.run(_traffic(gateway.url, duration_s=8.0, rate_rps=20.0))  # short chat: 160 fleet s
        deadline = time.monotonic() + 90.0  # the first plan evaluates the capacity model (seconds of CPU)
        while not any(d["kind"] == "plan" for d in _admin(gateway.url, "/admin/decisions")["decisions"]):  # type: ignore[index,union-attr]
            assert time.monotonic() < deadline, "no plan"
            time.sleep(0.5)
        time.sleep(1.0)  # a few more ticks (20 fleet s)
        decisions = _admin(gateway.url, "/admin/decisions")["decisions"]
        after = _declared_pools(gateway.url)
    finally:
        gateway.stop()
    assert statuses and set(statuses) == {200}
    plans = [d["evidence"] for d in decisions if d["kind"] == "plan"]  # type: ignore[index,union-attr]
    # sglang's defaults (the chat pool's declared engine) serve these tiny prompts as fast as any candidate: no recompile either
    assert plans and all(p["outcome"] == "keep" and not p["num_moves"] for p in plans), decisions  # type: ignore[index]
    assert "step" not in [d["kind"] for d in decisions]  # type: ignore[index]
    assert len(before["chat-h100"]) == len(before["long-h200"]) == 1 and after == before, (before, after)
