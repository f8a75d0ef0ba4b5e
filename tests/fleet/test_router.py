"""Routing policy: SLO-chance pool scores, shape pools first, overflow when saturated, queue or shed by tier, prefix affinity."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from scipy.stats import poisson

from classifiers.shape import Shape
from fleet.engines.load import EngineLoad
from fleet.health import CircuitBreaker, HealthState
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue
from fleet.router import Reject, Route, RouterSettings, Wait, foreign_requests, pick_replica, poisson_at_least, route, slo_chance, work_units
from kernels.tiers import DEFAULT_TIERS

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


def test_a_healthy_probe_does_not_clear_failures_and_a_quiet_cooldown_does() -> None:
    """/health 200 between failed requests, each a second apart: before, each probe cleared the count and
    the replica was never ejected. A run of failures ends with a request served or a quiet cool-down."""
    breaker = CircuitBreaker(eject_after=3, cooldown_s=5.0)
    ejected = []
    for second in range(3):
        assert not breaker.on_probe_success(breaker.on_dispatch())
        ejected.append(breaker.on_failure(second + 0.5))
    assert ejected == [False, False, True] and breaker.state is HealthState.EJECTED
    trial = breaker.on_dispatch()  # cool-down over: the probe is the trial, and its 200 readmits
    assert breaker.on_probe_success(trial)
    assert breaker.state is HealthState.HEALTHY and breaker.consecutive_failures == 0

    quiet = CircuitBreaker(eject_after=2, cooldown_s=5.0)
    assert not quiet.on_failure(0.0)
    assert not quiet.on_failure(5.5)  # 5.5 s after the last: a new run
    assert quiet.on_failure(10.0)  # 4.5 s after: the same run


def test_a_probe_sent_before_an_ejection_does_not_readmit_the_replica_when_its_200_comes_after() -> None:
    breaker = CircuitBreaker(eject_after=2, cooldown_s=5.0)
    probe = breaker.on_dispatch()  # /health sent while the replica is healthy
    assert not breaker.on_failure(0.1) and breaker.on_failure(0.2)  # requests eject it meanwhile
    assert not breaker.on_probe_success(probe) and breaker.state is HealthState.EJECTED
    assert not breaker.available(5.1)  # its cool-down stands
    trial = breaker.on_dispatch()  # after it, the next probe is the trial, and its 200 readmits
    assert breaker.on_probe_success(trial) and breaker.state is HealthState.HEALTHY


def test_a_trial_that_decided_nothing_lets_the_next_request_or_probe_be_the_trial() -> None:
    breaker = CircuitBreaker(eject_after=1, cooldown_s=5.0)
    assert breaker.on_dispatch() is None and breaker.on_failure(0.0)  # not a trial: a healthy replica's request
    first = breaker.on_dispatch()
    assert first == 1 and not breaker.available(6.0)
    breaker.on_undecided(first)  # its client left, or the replica answered 429
    assert breaker.state is HealthState.EJECTED and breaker.available(6.0)  # its cool-down is over: at once
    second = breaker.on_dispatch()
    breaker.on_undecided(first)  # a stale trial's end does not free the trial in flight
    assert second == 2 and breaker.state is HealthState.PROBING and not breaker.available(6.0)
    breaker.on_success()
    breaker.on_undecided(second)  # a decided trial stays decided
    assert breaker.state is HealthState.HEALTHY


def _modelled(name: str, shapes: set[str], in_flight: int, rate: float, cost_per_hour: float = 1.0, queued: bool = False) -> PoolState:
    """A pool of two replicas that saturates at 4 in flight each, with a capacity-model rate."""
    pool = _pool(name, shapes, num_replicas=2, max_running=4)
    pool.rate_per_replica_rps, pool.cost_per_hour = rate, cost_per_hour
    pool.replicas[0].num_in_flight, pool.replicas[1].num_in_flight = in_flight - in_flight // 2, in_flight // 2
    pool.queue = PoolQueue(max_len=64) if queued else None
    return pool


def test_slo_chance_is_the_poisson_chance_that_enough_requests_leave_in_time() -> None:
    pool = _modelled("chat", {"short-chat"}, in_flight=12, rate=2.0)  # 8 run at once: 5 must leave first
    wait_s = SETTINGS.wait_share * DEFAULT_TIERS["standard"].ttft_p99_s
    expected = 1.0 - sum(math.exp(-4.0 * wait_s) * (4.0 * wait_s) ** i / math.factorial(i) for i in range(5))
    assert slo_chance(pool, 0.0, priority=1, wait_s=wait_s) == pytest.approx(expected, rel=1e-12)
    assert slo_chance(_modelled("idle", {"short-chat"}, in_flight=7, rate=2.0), 0.0, 1, wait_s) == 1.0
    for k, mean in ((3, 0.5), (60, 40.0), (150, 120.0), (300, 250.0), (2300, 2400.0)):  # exact, then Wilson-Hilferty
        assert poisson_at_least(k, mean) == pytest.approx(float(poisson.sf(k - 1, mean)), rel=0.01)


def test_routing_picks_the_pool_the_model_predicts() -> None:
    # the shape's own pool is backed up; of two other pools equally backed up, the faster one is
    # likelier to start the request within its TTFT budget; with room everywhere, the own pool wins,
    # and an overflow with room goes to the cheaper pool per request
    own = _modelled("chat", {"short-chat"}, in_flight=14, rate=1.0)
    slow = _modelled("long", {"long-context"}, in_flight=10, rate=0.5)
    fast = _modelled("code", {"code"}, in_flight=10, rate=8.0)
    decision = route(SHAPE, "m", [own, slow, fast], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    chances = {p.name: slo_chance(p, 0.0, 1, 1.5) for p in (own, slow, fast)}
    assert isinstance(decision, Route) and decision.pool == max(chances, key=lambda n: chances[n]) == "code" and decision.overflow
    own = _modelled("chat", {"short-chat"}, in_flight=2, rate=0.1, cost_per_hour=9.0)
    cheap = _modelled("long", {"long-context"}, in_flight=0, rate=1.0, cost_per_hour=1.0)
    pricey = _modelled("code", {"code"}, in_flight=0, rate=1.0, cost_per_hour=5.0)
    assert route(SHAPE, "m", [pricey, cheap, own], 0.0, SETTINGS, tiers=DEFAULT_TIERS).pool == "chat"  # type: ignore[union-attr]
    own.replicas[0].num_in_flight = own.replicas[1].num_in_flight = 4
    assert route(SHAPE, "m", [pricey, cheap, own], 0.0, SETTINGS, tiers=DEFAULT_TIERS).pool == "long"  # type: ignore[union-attr]


def test_batch_is_shed_before_interactive_misses_when_the_pool_queue_is_long() -> None:
    pool = _modelled("chat", {"short-chat"}, in_flight=8, rate=0.5, queued=True)  # saturated: newcomers wait
    assert pool.queue is not None
    for k in range(40):
        assert pool.queue.offer(f"batch{k}", DEFAULT_TIERS["batch"].priority, 60.0) is None
    interactive = route(replace(SHAPE, tier="interactive"), "m", [pool], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(interactive, Wait) and interactive.priority == 0 and interactive.deadline_at == 0.5  # nobody of its tier ahead
    batch = route(replace(SHAPE, tier="batch"), "m", [pool], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    # 41 must leave at 1 req/s within its 30 s wait budget: hopeless, so it is refused now, not after 30 s
    assert isinstance(batch, Reject) and batch.status == 429 and batch.code == "shed" and batch.retry_after_s > SETTINGS.shed_retry_after_s
    assert pool.queue.offer("inter", interactive.priority, interactive.deadline_at) is None
    assert pool.queue.take(0.1)[0] == "inter"  # the interactive request is served first
    pool.queue = None  # a caller without queues (the gateway) keeps placing higher tiers
    assert isinstance(route(replace(SHAPE, tier="interactive"), "m", [pool], 0.0, SETTINGS, tiers=DEFAULT_TIERS), Route)


def test_without_a_capacity_model_pools_balance_on_work_per_replica_not_on_engine_batch_caps() -> None:
    # no shapes declared, no capacity model: a chat pool whose engines cap batches at 256 and a
    # long-context pool capped at 64 serve equally well; the request goes where each replica carries less
    chat, long = _pool("chat", set(), max_running=256), _pool("long", set(), max_running=64)
    for replica in chat.replicas:
        replica.num_in_flight = 3
    for replica in long.replicas:
        replica.num_in_flight = 1
    decision = route(SHAPE, "m", [chat, long], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "long"
    chat.rate_per_replica_rps = long.rate_per_replica_rps = 1.0  # with a model, its SLO concurrency is the capacity
    chat.max_running_per_replica, long.max_running_per_replica = 16, 4
    decision = route(SHAPE, "m", [chat, long], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "chat"


LONG = replace(SHAPE, name="long-context", prompt_tokens=6000, predicted_output_p50=300, predicted_output_p90=600)


def test_an_overflow_weighs_its_length_against_the_requests_a_pool_without_means_holds_now() -> None:
    chat = _pool("chat", {"short-chat"})
    assert work_units(LONG, chat) == 1.0  # idle: nothing to compare with
    for replica in chat.replicas:
        replica.num_in_flight, replica.outstanding_tokens = 3, 3 * 1050
    assert work_units(LONG, chat) == pytest.approx(6.0)  # 6,300 tokens against 1,050 per chat in flight
    assert work_units(SHAPE, chat) == 1.0  # its own shape counts 1
    chat.mean_prompt_tokens, chat.mean_output_tokens = 1500.0, 100.0  # a capacity model's means win
    assert work_units(LONG, chat) == pytest.approx(4.0)


def test_without_a_capacity_model_a_long_prompt_waits_in_its_own_pool_instead_of_stalling_the_chats() -> None:
    # the long-context pool is at its engines' batch cap; the chat pool is far below its own but busy
    # with short requests: a 6k-token prefill there would stall every chat, and nothing says it would
    # meet its own SLO either, so it stays home (the engine queues it)
    chat, long = _pool("chat", {"short-chat"}, max_running=256), _pool("long", {"long-context"}, max_running=4)
    for replica in chat.replicas:
        replica.num_in_flight, replica.outstanding_tokens = 20, 20 * 1050
    for replica in long.replicas:
        replica.num_in_flight, replica.outstanding_tokens = 4, 4 * 6300
    decision = route(LONG, "m", [chat, long], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Route) and decision.pool == "long" and not decision.overflow
    light = replace(SHAPE, name="long-context", prompt_tokens=500)  # no heavier than a chat: overflow is harmless
    decision = route(light, "m", [chat, long], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Route) and decision.pool == "chat" and decision.overflow
    chat.rate_per_replica_rps = long.rate_per_replica_rps = 1.0  # a capacity model: the chat pool has room, home is backed up
    for replica in long.replicas:
        replica.num_in_flight = 6
    decision = route(LONG, "m", [chat, long], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Route) and decision.pool == "chat" and decision.overflow


def test_a_tighter_tier_spills_into_a_pool_sized_for_a_looser_tpot_only_while_that_pool_keeps_its_tpot() -> None:
    # the chat pool is backed up; the code pool was sized for the standard tier's 100 ms TPOT, 8 slots:
    # an interactive chat (50 ms) counts on the half of them that keeps its own TPOT (overflow may
    # otherwise fill the pool here: the TPOT rule alone)
    settings = RouterSettings(overflow_share=1.0)
    interactive = replace(SHAPE, tier="interactive")
    chat = _modelled("chat", {"short-chat"}, in_flight=9, rate=1.0, queued=True)
    code = _modelled("code", {"code"}, in_flight=3, rate=1.0)
    code.tpot_objective_s, chat.tpot_objective_s = DEFAULT_TIERS["standard"].tpot_p99_s, DEFAULT_TIERS["interactive"].tpot_p99_s
    decision = route(interactive, "m", [chat, code], 0.0, settings, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Route) and decision.pool == "code" and decision.overflow  # 3 of 4 slots: room
    code.replicas[0].num_in_flight = code.replicas[1].num_in_flight = 3  # room for standard work, not for a chat's TPOT
    decision = route(interactive, "m", [chat, code], 0.0, settings, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Wait) and decision.pool == "chat"  # it waits at home, ahead of standard work
    assert route(SHAPE, "m", [chat, code], 0.0, settings, tiers=DEFAULT_TIERS).pool == "code"  # type: ignore[union-attr]
    code.tpot_objective_s = 0.0  # a pool of unknown TPOT: every slot counts, as before
    assert route(interactive, "m", [chat, code], 0.0, settings, tiers=DEFAULT_TIERS).pool == "code"  # type: ignore[union-attr]


def test_overflow_counts_on_part_of_another_shapes_pool_and_leaves_the_rest_to_its_own_requests() -> None:
    # the code pool is backed up; the chat pool (2 replicas x 4 slots, a capacity model) holds 3 chats:
    # a code request counts on half its slots (4), so it overflows there while it has room; once chats and
    # overflow hold 6 it waits at home (a better chance), and the chat pool's own requests still find their slots
    code = _modelled("code", {"code"}, in_flight=9, rate=1.0, queued=True)
    chat = _modelled("chat", {"short-chat"}, in_flight=3, rate=1.0)
    work = replace(SHAPE, name="code")
    decision = route(work, "m", [code, chat], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Route) and decision.pool == "chat" and decision.overflow
    chat.replicas[0].num_in_flight = 5  # 6 in flight: three must leave before an overflow runs
    decision = route(work, "m", [code, chat], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(decision, Wait) and decision.pool == "code"
    assert route(work, "m", [code, chat], 0.0, RouterSettings(overflow_share=1.0), tiers=DEFAULT_TIERS).pool == "chat"  # type: ignore[union-attr]
    own = route(SHAPE, "m", [code, chat], 0.0, SETTINGS, tiers=DEFAULT_TIERS)
    assert isinstance(own, Route) and own.pool == "chat" and not own.overflow  # its own shape: every slot
    with pytest.raises(ValueError, match="overflow_share"):
        RouterSettings(overflow_share=0.0)


def test_a_replica_another_client_loads_takes_new_requests_last() -> None:
    chat = _pool("chat", {"short-chat"})
    busy, idle = chat.replicas
    idle.num_in_flight, idle.outstanding_tokens = 1, 300  # our own request on the other replica
    assert pick_replica(SHAPE, "m", chat.replicas, 0.0, SETTINGS) is busy  # the gateway's counts alone: busy looks idle
    home = next(fp for fp in range(1, 200) if pick_replica(replace(SHAPE, prefix_fp=fp), "m", chat.replicas, 0.0, SETTINGS) is busy)
    busy.engine = EngineLoad(scraped_at=0.0, num_running=2, num_waiting=10)  # a direct client's twelve generations
    busy.foreign_requests = foreign_requests(busy.engine, busy.num_in_flight)
    assert busy.foreign_requests == 12
    assert pick_replica(SHAPE, "m", chat.replicas, 0.0, SETTINGS) is idle
    # a prefix whose home is the loaded replica moves on too: its load passes affinity's bound
    assert pick_replica(replace(SHAPE, prefix_fp=home), "m", chat.replicas, 0.0, SETTINGS) is idle


def test_requests_the_gateway_sent_are_not_counted_twice() -> None:
    chat = _pool("chat", {"short-chat"})
    ours, other = chat.replicas
    ours.num_in_flight, ours.outstanding_tokens = 3, 3 * 150
    other.num_in_flight, other.outstanding_tokens = 4, 4 * 150
    ours.engine = EngineLoad(scraped_at=0.0, num_running=3, num_waiting=0)  # the engine holds exactly our three
    ours.foreign_requests = foreign_requests(ours.engine, ours.num_in_flight)
    assert ours.foreign_requests == 0 and ours.work_in_flight == 3
    assert pick_replica(SHAPE, "m", chat.replicas, 0.0, SETTINGS) is ours
    ours.begin(150)  # sent after the scrape: counted once, in our own books
    assert ours.work_in_flight == 4


def test_pool_scores_count_foreign_requests() -> None:
    chat, long = _pool("chat", {"short-chat"}, num_replicas=1, max_running=2), _pool("long", {"long-context"})
    assert route(SHAPE, "m", [chat, long], 0.0, SETTINGS).pool == "chat"  # type: ignore[union-attr]
    chat.replicas[0].foreign_requests = 2  # full with another client's requests
    assert slo_chance(chat, 0.0, 1, 1.0) < 1.0 and chat.load_fraction(0.0) == 1.0
    decision = route(SHAPE, "m", [chat, long], 0.0, SETTINGS)
    assert isinstance(decision, Route) and decision.pool == "long" and decision.overflow


def test_an_urgent_reserve_keeps_batch_out_of_the_last_slots_and_lets_interactive_in() -> None:
    """With ``urgent_reserve`` a batch flood leaves a queued pool's last running slots free: batch waits in
    the pool's queue once a replica holds its share, an interactive request still starts at once, and
    the dispatcher wakes batch only into the share it may take."""
    from fleet.dispatch import Queued, pump

    settings = RouterSettings(urgent_reserve=0.25)
    pool = _pool("chat", {"short-chat"}, num_replicas=1, max_running=4)
    pool.queue = PoolQueue(max_len=64)
    batch, interactive = replace(SHAPE, tier="batch"), replace(SHAPE, tier="interactive")
    pool.replicas[0].num_in_flight = 3  # batch's share of 4 slots, less a quarter

    assert isinstance(route(batch, "m", [pool], 0.0, settings, tiers=DEFAULT_TIERS), Wait)
    assert isinstance(route(interactive, "m", [pool], 0.0, settings, tiers=DEFAULT_TIERS), Route)
    assert isinstance(route(batch, "m", [pool], 0.0, SETTINGS, tiers=DEFAULT_TIERS), Route)  # no reserve: batch takes the 4th

    placed: list[tuple[str, str | None]] = []
    shapes = {"b": batch, "i": interactive}
    pool.queue.offer("b", DEFAULT_TIERS["batch"].priority, 100.0)

    def admit(item: str, replica: ReplicaState | None) -> None:
        placed.append((item, None if replica is None else replica.name))
        if replica is not None:
            replica.num_in_flight += 1

    def wake() -> None:
        pump(pool, pool.queue, 0.0, settings, lambda item: Queued(shapes[item], "m"), admit, lambda shed: None)  # type: ignore[arg-type]

    wake()
    assert placed == [] and len(pool.queue) == 1  # the reserved slot is not batch's
    pool.queue.offer("i", DEFAULT_TIERS["interactive"].priority, 100.0)
    wake()
    assert placed == [("i", "chat-0")] and len(pool.queue) == 1  # interactive, queued behind nobody, takes it
    pool.replicas[0].num_in_flight = 2  # two finished: batch may hold one more
    wake()
    assert placed[-1] == ("b", "chat-0") and len(pool.queue) == 0
