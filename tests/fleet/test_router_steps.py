"""The router's named steps: the default composition is the router as it was, each alternative changes the answer
the way it says, and an unknown step name is refused (by RouterSettings, and in a config file with its line)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from classifiers.shape import Shape
from fleet.dispatch import Queued, pump
from fleet.health import CircuitBreaker
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue, Shed
from fleet.router import Reject, Route, RouterSettings, Wait, pick_replica, route
from fleet.router_steps import STEPS, least_load_score, least_work, prefix_affinity
from gateway.config import load_config
from kernels.tiers import DEFAULT_TIERS
from tests.gateway.test_config import _copy_example, _error_for, _line_of

CHAT = Shape("short-chat", "chat", 0.9, 100, 50, 120, "standard", "demo", 0, None, False)
LONG = Shape("long-context", "long", 0.9, 6000, 200, 400, "standard", "demo", 0, None, False)


def _pool(name: str, shapes: set[str], num_replicas: int = 2, max_running: int = 4, rate_rps: float = 0.0, queue: bool = False) -> PoolState:
    pool = PoolState(name, frozenset({"m"}), frozenset(shapes), "H100-SXM", max_running, rate_per_replica_rps=rate_rps, cost_per_hour=2.0,
                     mean_prompt_tokens=1000.0 if rate_rps else 0.0, mean_output_tokens=200.0 if rate_rps else 0.0,
                     queue=PoolQueue[int](64) if queue else None)
    for i in range(num_replicas):
        pool.replicas.append(ReplicaState(f"{name}-{i}", f"http://r/{name}/{i}", name, CircuitBreaker(2, 5.0), affinity_salt=i * 7919))
    return pool


def _load(pool: PoolState, *num_in_flight: int) -> PoolState:
    for replica, n in zip(pool.replicas, num_in_flight):
        replica.num_in_flight, replica.outstanding_tokens = n, 150 * n
    return pool


def _decisions(settings: RouterSettings) -> list[Route | Wait | Reject]:
    """A few fleets and requests: one pool, shape pools with and without capacity models, overflow, queues, shedding, retries."""
    out: list[Route | Wait | Reject] = []
    one = [_load(_pool("chat", {"short-chat"}, num_replicas=4), 3, 1, 2, 0)]
    for fp in (0, 11, 222, 3333):
        out.append(route(replace(CHAT, prefix_fp=fp), "m", one, 0.0, settings, tiers=DEFAULT_TIERS))
    out.append(route(CHAT, "m", one, 0.0, settings, exclude=["chat-3", "chat-1"]))
    modelled = [_load(_pool("chat", {"short-chat"}, rate_rps=4.0, queue=True), 4, 3), _load(_pool("long", {"long-context"}, rate_rps=1.0, queue=True), 1, 0),
                _load(_pool("spare", {"reasoning"}, num_replicas=1, rate_rps=2.0, queue=True), 2)]
    for shape in (CHAT, LONG, replace(CHAT, tier="interactive", prefix_fp=99), replace(LONG, tier="batch")):
        out.append(route(shape, "m", modelled, 0.0, settings, tiers=DEFAULT_TIERS))
    _load(modelled[0], 4, 4)
    _load(modelled[1], 4, 4)
    _load(modelled[2], 4)
    out.append(route(CHAT, "m", modelled, 0.0, settings, tiers=DEFAULT_TIERS))
    out.append(route(replace(CHAT, tier="batch"), "m", modelled, 0.0, settings, tiers=DEFAULT_TIERS))
    hurried = [_load(_pool("chat", {"short-chat"}, rate_rps=0.5, queue=True), 4, 4), _pool("long", {"long-context"}, rate_rps=1.0)]
    out.append(route(replace(CHAT, prompt_tokens=3000), "m", hurried, 0.0, settings, tiers=DEFAULT_TIERS))  # overflow weighing 3
    slow = [_load(_pool("chat", {"short-chat"}, rate_rps=0.01, queue=True), 4, 4)]
    out.append(route(replace(CHAT, tier="interactive"), "m", slow, 0.0, settings, tiers=DEFAULT_TIERS))  # hopeless: shed at once
    plain = [_load(_pool("chat", {"short-chat"}), 4, 4), _load(_pool("long", {"long-context"}, max_running=2), 1, 0)]
    for shape in (CHAT, LONG, replace(LONG, prompt_tokens=60_000), replace(CHAT, tier="batch")):
        out.append(route(shape, "m", plain, 0.0, settings, tiers=DEFAULT_TIERS))
    out.append(route(CHAT, "other", plain, 0.0, settings))
    return out


# What the router answered for _decisions before its steps had names (fleet/router.py at 6c62ba7).
BEFORE: list[Route | Wait | Reject] = [
    Route(pool='chat', replica='chat-3', url='http://r/chat/3', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-1', url='http://r/chat/1', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-0', url='http://r/chat/0', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-1', url='http://r/chat/1', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-2', url='http://r/chat/2', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-1', url='http://r/chat/1', overflow=False, work=1.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=False, work=1.0),
    Route(pool='chat', replica='chat-0', url='http://r/chat/0', overflow=False, work=1.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=False, work=1.0),
    Wait(pool='chat', priority=1, deadline_at=1.5, slo_chance=0.9999938557876467, overflow=False),
    Wait(pool='chat', priority=2, deadline_at=30.0, slo_chance=1.0, overflow=False),
    Route(pool='long', replica='long-0', url='http://r/long/0', overflow=True, work=3.0),
    Reject(status=429, code='shed', reason="capacity is short; a tier 'interactive' request would miss its SLO", retry_after_s=50.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=True, work=1.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=False, work=1.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=False, work=1.0),
    Route(pool='long', replica='long-1', url='http://r/long/1', overflow=True, work=1.0),
    Reject(status=404, code='model_not_found', reason="no pool serves model 'other'", retry_after_s=0.0),
]


def test_default_composition_answers_as_the_router_did_before() -> None:
    explicit = RouterSettings(pool_filter="serves_model", pool_scorer="slo_chance", admission="queue_or_shed",
                              replica_filter="untried_routable", replica_picker="prefix_affinity")
    assert explicit == RouterSettings() and all(next(iter(STEPS[stage])) == getattr(explicit, stage) for stage in STEPS)
    assert _decisions(RouterSettings()) == BEFORE
    assert _decisions(explicit) == BEFORE


def test_the_steps_are_composed_once_per_settings() -> None:
    settings = RouterSettings(replica_picker="least_work")
    assert settings.steps is settings.steps and settings.steps.replica_picker is least_work
    again = replace(settings, replica_picker="prefix_affinity")  # a changed copy composes its own steps
    assert again.steps.replica_picker is prefix_affinity and settings.steps.replica_picker is least_work


def test_own_shape_keeps_a_saturated_shape_at_home_instead_of_overflowing() -> None:
    pools = [_load(_pool("chat", {"short-chat"}), 4, 4), _pool("long", {"long-context"})]
    overflow = route(CHAT, "m", pools, 0.0, RouterSettings())
    assert isinstance(overflow, Route) and overflow.pool == "long" and overflow.overflow
    home = route(CHAT, "m", pools, 0.0, RouterSettings(pool_filter="own_shape"))
    assert isinstance(home, Route) and home.pool == "chat" and not home.overflow
    # a shape with no pool of its own may still use any pool that serves the model
    assert isinstance(route(replace(CHAT, name="reasoning"), "m", pools, 0.0, RouterSettings(pool_filter="own_shape")), Route)


def test_least_load_ignores_slo_chance_and_the_own_shape_preference() -> None:
    pools = [_load(_pool("chat", {"short-chat"}, rate_rps=10.0), 3, 3), _pool("long", {"long-context"}, rate_rps=10.0)]
    own = route(CHAT, "m", pools, 0.0, RouterSettings())  # both are sure to meet the SLO: the shape's own pool first
    assert isinstance(own, Route) and own.pool == "chat"
    lighter = route(CHAT, "m", pools, 0.0, RouterSettings(pool_scorer="least_load"))
    assert isinstance(lighter, Route) and lighter.pool == "long" and lighter.overflow
    # a pool that cannot meet the SLO still wins on load: the busier, fast pool wins on chance alone
    chance = [_load(_pool("chat", {"short-chat"}, rate_rps=10.0), 6, 6), _load(_pool("slow", {"short-chat"}, num_replicas=4, rate_rps=0.001), 4, 4, 4, 4)]
    by_chance, by_load = route(CHAT, "m", chance, 0.0, RouterSettings()), route(CHAT, "m", chance, 0.0, RouterSettings(pool_scorer="least_load"))
    assert isinstance(by_chance, Route) and by_chance.pool == "chat" and isinstance(by_load, Route) and by_load.pool == "slow"


def test_shed_only_never_queues_and_admit_all_never_sheds() -> None:
    def fleet() -> list[PoolState]:
        return [_load(_pool("chat", {"short-chat"}, rate_rps=4.0, queue=True), 4, 4)]

    assert isinstance(route(CHAT, "m", fleet(), 0.0, RouterSettings(), tiers=DEFAULT_TIERS), Wait)
    placed = route(CHAT, "m", fleet(), 0.0, RouterSettings(admission="shed_only"), tiers=DEFAULT_TIERS)
    assert isinstance(placed, Route) and placed.pool == "chat"  # onto a full replica: its engine queues it
    batch = replace(CHAT, tier="batch")
    shed = route(batch, "m", fleet(), 0.0, RouterSettings(admission="shed_only"), tiers=DEFAULT_TIERS)
    assert isinstance(shed, Reject) and shed.status == 429
    assert isinstance(route(batch, "m", fleet(), 0.0, RouterSettings(admission="admit_all"), tiers=DEFAULT_TIERS), Route)


def test_routable_lets_a_retry_return_to_the_only_replica() -> None:
    pools = [_pool("chat", {"short-chat"}, num_replicas=1)]
    refused = route(CHAT, "m", pools, 0.0, RouterSettings(), exclude=["chat-0"])
    assert isinstance(refused, Reject) and refused.status == 503
    again = route(CHAT, "m", pools, 0.0, RouterSettings(replica_filter="routable"), exclude=["chat-0"])
    assert isinstance(again, Route) and again.replica == "chat-0"
    pools[0].replicas[0].draining = True  # routable still means routable
    assert isinstance(route(CHAT, "m", pools, 0.0, RouterSettings(replica_filter="routable")), Reject)


def test_least_work_ignores_the_prefix() -> None:
    replicas = _load(_pool("chat", {"short-chat"}, num_replicas=4), 1, 1, 0, 1).replicas
    homes = {pick_replica(replace(CHAT, prefix_fp=fp), "m", replicas, 0.0, RouterSettings()) for fp in range(1, 40)}
    assert len(homes) > 1  # prefixes spread over the replicas
    least = RouterSettings(replica_picker="least_work")
    assert {pick_replica(replace(CHAT, prefix_fp=fp), "m", replicas, 0.0, least) for fp in range(1, 40)} == {replicas[2]}


def test_the_dispatcher_places_queued_requests_with_the_same_steps() -> None:
    def placed(settings: RouterSettings, with_prefix: bool) -> list[str]:
        pool = _load(_pool("chat", {"short-chat"}, num_replicas=3), 3, 0, 1)
        queue = PoolQueue[int](8)
        for fp in range(1, 9):
            queue.offer(fp, 1, 60.0)
        names: list[str] = []

        def admit(fp: int, replica: ReplicaState | None) -> None:
            assert replica is not None
            replica.begin(150)
            names.append(replica.name)

        def shed(expired: list[Shed[int]]) -> None:
            raise AssertionError(expired)

        pump(pool, queue, 0.0, settings, lambda fp: Queued(replace(CHAT, prefix_fp=fp if with_prefix else 0), "m"), admit, shed)
        return names

    least_work_order = placed(RouterSettings(), with_prefix=False)
    assert len(least_work_order) == 8 and placed(RouterSettings(), with_prefix=True) != least_work_order  # affinity moved some
    assert placed(RouterSettings(replica_picker="least_work"), with_prefix=True) == least_work_order  # whatever the prefix


def test_an_unknown_step_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown replica_picker 'random' \(known: prefix_affinity, least_work\)"):
        RouterSettings(replica_picker="random")


def test_an_unknown_step_in_a_config_file_names_its_file_and_line(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "  pool_scorer: slo_chance", "  pool_scorer: fastest")
    assert err.file.endswith("config.yaml") and err.line == _line_of(Path(err.file), "pool_scorer: fastest")
    assert err.field == "router.pool_scorer" and "unknown step 'fastest'" in err.reason and "slo_chance, least_load" in err.reason
    err = _error_for(tmp_path, "  replica_picker: prefix_affinity", "  replica_picker: [least_work]")
    assert err.field == "router.replica_picker" and err.line == _line_of(Path(err.file), "replica_picker: [least_work]")


def test_a_config_file_names_the_steps_the_router_runs(tmp_path: Path) -> None:
    path = _copy_example(tmp_path)
    text = path.read_text()
    for old, new in (("replica_picker: prefix_affinity", "replica_picker: least_work"), ("pool_scorer: slo_chance", "pool_scorer: least_load")):
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    router = load_config(path).router
    assert (router.replica_picker, router.pool_scorer) == ("least_work", "least_load")
    assert router.steps.replica_picker is least_work and router.steps.pool_scorer is least_load_score
