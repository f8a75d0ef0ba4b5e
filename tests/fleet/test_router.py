"""Routing policy: shape pools first, overflow when saturated, prefix affinity with bounded load."""

from __future__ import annotations

from dataclasses import replace

from classifiers.shape import Shape
from fleet.health import CircuitBreaker, HealthState
from fleet.pool import PoolState, ReplicaState
from fleet.router import Reject, Route, RouterSettings, pick_replica, route

SETTINGS = RouterSettings()
SHAPE = Shape("short-chat", "chat", 0.9, 100, 50, 120, "standard", "demo", 0, None, False)


def _pool(name: str, shapes: set[str], num_replicas: int = 2, max_running: int = 4) -> PoolState:
    pool = PoolState(name, frozenset({"m"}), frozenset(shapes), "H100-SXM", max_running)
    for i in range(num_replicas):
        pool.replicas.append(ReplicaState(f"{name}-{i}", f"http://r/{name}/{i}", name, CircuitBreaker(2, 5.0), affinity_salt=i * 7919))
    return pool


def test_prefers_the_pool_compiled_for_the_shape() -> None:
    chat, long = _pool("chat", {"short-chat"}), _pool("long", {"long-context"})
    decision = route(SHAPE, "m", [long, chat], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "chat" and not decision.overflow
    decision = route(replace(SHAPE, name="long-context"), "m", [long, chat], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "long"


def test_overflows_to_another_pool_only_when_saturated() -> None:
    chat, long = _pool("chat", {"short-chat"}, num_replicas=1, max_running=2), _pool("long", {"long-context"})
    chat.replicas[0].num_in_flight = 2
    decision = route(SHAPE, "m", [chat, long], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "long" and decision.overflow
    long.replicas[0].num_in_flight = long.replicas[1].num_in_flight = 4
    decision = route(SHAPE, "m", [chat, long], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "chat"  # everything is full: stay home


def test_unknown_model_and_no_healthy_replica_are_rejections() -> None:
    chat = _pool("chat", {"short-chat"}, num_replicas=1)
    assert route(SHAPE, "other", [chat], 0.0, SETTINGS) == Reject(404, "model_not_found", "no pool serves model 'other'", 0.0)
    chat.replicas[0].breaker.on_failure(0.0)
    chat.replicas[0].breaker.on_failure(0.0)
    decision = route(SHAPE, "m", [chat], 1.0, SETTINGS)
    assert isinstance(decision, Reject) and decision.status == 503 and decision.retry_after_s > 0


def test_excluded_replicas_are_skipped_for_retries() -> None:
    chat = _pool("chat", {"short-chat"})
    first = route(SHAPE, "m", [chat], 0.0, SETTINGS)
    assert isinstance(first, Route)
    second = route(SHAPE, "m", [chat], 0.0, SETTINGS, exclude=[first.replica])
    assert isinstance(second, Route) and second.replica != first.replica


def test_least_outstanding_work_without_prefix() -> None:
    chat = _pool("chat", {"short-chat"}, num_replicas=3)
    chat.replicas[0].outstanding_tokens = 500
    chat.replicas[1].outstanding_tokens = 100
    chat.replicas[2].outstanding_tokens = 900
    assert pick_replica(SHAPE, "m", chat.replicas, 0.0, SETTINGS) is chat.replicas[1]


def test_prefix_affinity_is_stable_and_bounded() -> None:
    chat = _pool("chat", {"short-chat"}, num_replicas=4)
    shaped = replace(SHAPE, prefix_fp=123456789)
    home = pick_replica(shaped, "m", chat.replicas, 0.0, SETTINGS)
    assert home is not None
    for replica in chat.replicas:
        replica.outstanding_tokens = 10_000 if replica is home else 0
    assert pick_replica(shaped, "m", chat.replicas, 0.0, SETTINGS) is home  # affinity beats token balance
    home.num_in_flight = 50  # far above the pool's mean: bounded load moves the prefix on
    moved = pick_replica(shaped, "m", chat.replicas, 0.0, SETTINGS)
    assert moved is not None and moved is not home
    home.num_in_flight = 0
    homes = {pick_replica(replace(SHAPE, prefix_fp=fp), "m", chat.replicas, 0.0, SETTINGS).name for fp in range(1, 200)}  # type: ignore[union-attr]
    assert len(homes) == 4  # prefixes spread over every replica


def test_decision_is_immutable_and_independent_of_later_state() -> None:
    chat = _pool("chat", {"short-chat"})
    decision = route(SHAPE, "m", [chat], 0.0, SETTINGS)
    chat.replicas.clear()
    assert isinstance(decision, Route) and decision.replica.startswith("chat-")


def test_circuit_breaker_ejects_cools_down_and_probes_once() -> None:
    breaker = CircuitBreaker(eject_after=2, cooldown_s=5.0)
    assert not breaker.on_failure(0.0)
    assert breaker.on_failure(1.0) and breaker.state is HealthState.EJECTED
    assert not breaker.available(5.9)
    assert breaker.available(6.0)
    breaker.on_dispatch()
    assert breaker.state is HealthState.PROBING and not breaker.available(6.1)  # one trial at a time
    assert breaker.on_failure(6.2) and not breaker.available(11.0)  # failed trial: a new cool-down
    assert breaker.available(11.5)
    breaker.on_dispatch()
    breaker.on_success()
    assert breaker.state is HealthState.HEALTHY and breaker.available(11.6) and breaker.num_ejections == 2
