"""The urgent reserve sized from the urgent requests a pool had in flight together (fleet.urgent_demand)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleet.pool import PoolState
from fleet.queueing import PoolQueue
from fleet.restart_hold import Restart, hold_pool
from fleet.router import Route, RouterSettings, Wait, route
from fleet.router_steps import slots_per_replica
from fleet.urgent_demand import UrgentDemand
from kernels.tiers import DEFAULT_TIERS
from tests.fleet.test_router import SHAPE, _pool

BATCH, INTERACTIVE = DEFAULT_TIERS["batch"].priority, DEFAULT_TIERS["interactive"].priority


def test_the_peak_is_the_most_in_flight_together_within_the_window() -> None:
    demand = UrgentDemand(window_s=10.0)
    assert demand.peak(0.0) == 0
    demand.begin(0.0)
    demand.begin(1.0)  # two together
    demand.end(2.0)
    assert demand.peak(5.0) == 2 and demand.peak(11.9) == 2  # two were in flight until 2.0
    assert demand.peak(12.1) == 1  # the pair left the window; one is still in flight
    demand.end(13.0)
    assert demand.peak(13.0) == 1 and demand.peak(23.1) == 0
    with pytest.raises(ValueError, match="window_s"):
        UrgentDemand(0.0)


def _queued_pool(num_replicas: int = 1) -> PoolState:
    pool = _pool("chat", {"short-chat"}, num_replicas=num_replicas, max_running=4)
    pool.queue = PoolQueue(max_len=64)
    pool.urgent_demand = UrgentDemand(window_s=30.0)
    return pool


def test_batch_keeps_the_share_until_urgent_requests_overlap_then_leaves_room_for_them_and_one_more() -> None:
    settings = RouterSettings(urgent_reserve=0.25)
    pool = _queued_pool()
    demand = pool.urgent_demand
    assert demand is not None
    assert slots_per_replica(pool, BATCH, settings, 0.0) == 3  # nothing urgent seen: the share alone (a quarter of 4)
    demand.begin(0.0)
    assert slots_per_replica(pool, BATCH, settings, 0.0) == 2  # one in flight: it, and room for the next
    demand.begin(0.5)
    assert slots_per_replica(pool, BATCH, settings, 0.5) == 1  # two together: batch keeps one slot, never none
    assert slots_per_replica(pool, INTERACTIVE, settings, 0.5) == 4
    demand.end(1.0)
    demand.end(1.5)
    assert slots_per_replica(pool, BATCH, settings, 20.0) == 1  # remembered for the window
    assert slots_per_replica(pool, BATCH, settings, 31.6) == 3  # then (the last one left at 1.5) the share again
    assert slots_per_replica(pool, BATCH, RouterSettings(), 0.0) == 4  # no reserve at all: nothing is measured against


def test_the_measured_reserve_spreads_over_the_pools_replicas_and_turns_batch_away() -> None:
    settings = RouterSettings(urgent_reserve=0.25)
    pool = _queued_pool(num_replicas=2)
    demand = pool.urgent_demand
    assert demand is not None
    for at in (0.0, 0.1):
        demand.begin(at)
    assert slots_per_replica(pool, BATCH, settings, 0.2) == 2  # one each, plus one
    for replica in pool.replicas:
        replica.num_in_flight = 2
    batch, interactive = replace(SHAPE, tier="batch"), replace(SHAPE, tier="interactive")
    assert isinstance(route(batch, "m", [pool], 0.2, settings, tiers=DEFAULT_TIERS), Wait)
    assert isinstance(route(interactive, "m", [pool], 0.2, settings, tiers=DEFAULT_TIERS), Route)


def test_a_request_is_held_only_while_no_replica_serves_its_model_and_one_is_coming_back() -> None:
    chat, long = _pool("chat", {"short-chat"}, num_replicas=1), _pool("long", {"long-context"}, num_replicas=1)
    back = (Restart("chat-0", "chat", "m"),)
    assert hold_pool("m", [chat, long], back, 0.0) is None  # routable replicas: route as usual
    for pool in (chat, long):
        pool.replicas[0].draining = True
    assert hold_pool("m", [chat, long], back, 0.0) == "chat"
    assert hold_pool("m", [chat, long], (), 0.0) is None  # nothing coming back: the 503 stands
    assert hold_pool("other", [chat, long], back, 0.0) is None
