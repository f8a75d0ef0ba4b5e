"""Processor sharing of a replica's engine time (fleet.engine_share), with an injected clock."""

from __future__ import annotations

import random

import pytest

from fleet.engine_share import ShareClock


def test_a_lone_request_gets_all_its_time_and_idle_time_is_nobodys() -> None:
    clock = ShareClock()
    mark = clock.begin(10.0)
    assert clock.end(12.5, mark) == pytest.approx(2.5)
    mark = clock.begin(100.0)  # 87.5 s idle in between: charged to no one
    assert clock.end(101.0, mark) == pytest.approx(1.0)


def test_two_overlapping_requests_split_the_overlap() -> None:
    clock = ShareClock()
    a = clock.begin(0.0)
    b = clock.begin(1.0)  # a alone for 1 s, then both for 2 s, then b alone for 3 s
    share_a = clock.end(3.0, a)
    share_b = clock.end(6.0, b)
    assert share_a == pytest.approx(1.0 + 2.0 / 2)
    assert share_b == pytest.approx(2.0 / 2 + 3.0)


def test_the_shares_of_all_requests_sum_to_the_replicas_busy_time() -> None:
    rng = random.Random(7)
    events: list[tuple[float, int, int]] = []  # (time, 0 start / 1 end, request)
    for i in range(200):
        start = rng.uniform(0.0, 100.0)
        events += [(start, 0, i), (start + rng.expovariate(1.0), 1, i)]
    events.sort()
    clock = ShareClock()
    marks: dict[int, float] = {}
    total_share = busy = 0.0
    busy_since = 0.0
    for at, kind, i in events:
        if kind == 0:
            if clock.num_in_flight == 0:
                busy_since = at
            marks[i] = clock.begin(at)
        else:
            total_share += clock.end(at, marks.pop(i))
            if clock.num_in_flight == 0:
                busy += at - busy_since
    assert busy > 0 and total_share == pytest.approx(busy)
