"""Act: turn a plan diff into moves, batch them, and carry each move out drain-first.

``diff_moves`` decides which replica slots (a slot is one replica's GPUs, of one kind) change pool
or configuration; ``batch_moves`` cuts them into steps of at most ``max_fraction`` of the fleet; a
``Mover`` carries a step out through an ``Actuator``: drain (the router sends the slot nothing new),
wait until its in-flight requests have finished, stop, start with the new configuration, wait for
health, and only then make it routable in its new pool. Nothing is aborted, so no request is dropped
by a move. The same Mover drives the simulator's virtual actuator and the gateway's local one.

Both waits have deadlines. A drain that outlasts ``drain_timeout_s`` stops the slot anyway (the
requests still on it end with a clear error instead of holding the rollout forever); a start that
is not healthy within ``start_timeout_s`` fails the move, and the controller rolls the step back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fleet.decisions import Move


class Actuator(Protocol):
    """What a controller needs from whoever owns the replicas; every call returns at once."""

    def drain(self, slot: str, now: float) -> None: ...  # routable no more; in-flight work goes on
    def num_in_flight(self, slot: str) -> int: ...
    def stop(self, slot: str, now: float) -> None: ...
    def start(self, slot: str, pool: str, config_json: str, now: float) -> None: ...  # begins start-up
    def is_healthy(self, slot: str, now: float) -> bool: ...  # started and answering /health
    def activate(self, slot: str, now: float) -> None: ...  # routable in its (new) pool


@dataclass(frozen=True, slots=True)
class SlotState:
    slot: str
    pool: str
    gpu: str
    config_json: str
    alive: bool = True  # False: its replica process is gone (or ejected for long); its GPUs serve nothing


def diff_moves(
    slots: list[SlotState],
    target: Mapping[str, int],
    pool_to_gpu: Mapping[str, str],
    pool_to_config_json: Mapping[str, str],
) -> list[Move]:
    """Moves that turn ``slots`` into ``target`` replica counts; a kept slot whose pool's configuration
    changed is restarted in place (a recompile). Deterministic: slots leave in name order."""
    moves: list[Move] = []
    for gpu in sorted({s.gpu for s in slots}):
        mine = sorted((s for s in slots if s.gpu == gpu), key=lambda s: s.slot)
        pools = sorted({s.pool for s in mine} | {p for p, g in pool_to_gpu.items() if g == gpu})
        leaving: list[SlotState] = []
        staying: list[SlotState] = []
        for pool in pools:
            members = [s for s in mine if s.pool == pool]
            keep = min(len(members), target.get(pool, 0))
            staying.extend(members[:keep])
            leaving.extend(members[keep:])
        for pool in pools:
            deficit = target.get(pool, 0) - sum(1 for s in staying if s.pool == pool)
            while deficit > 0 and leaving:
                slot = leaving.pop(0)
                moves.append(Move(slot.slot, slot.pool, pool, pool_to_config_json[pool]))
                deficit -= 1
        for slot in staying:
            wanted = pool_to_config_json.get(slot.pool, slot.config_json)
            if wanted != slot.config_json:
                moves.append(Move(slot.slot, slot.pool, slot.pool, wanted))
    return moves


def batch_moves(moves: list[Move], fleet_size: int, max_fraction: float) -> list[tuple[Move, ...]]:
    """Steps of at most ``max_fraction`` of the fleet (at least one move each)."""
    size = max(1, math.floor(max_fraction * fleet_size))
    return [tuple(moves[i : i + size]) for i in range(0, len(moves), size)]


@dataclass(slots=True)
class _Progress:
    move: Move
    phase: str  # "draining", "starting", then "done" or "failed" (never became healthy)
    since: float


class Mover:
    """Carries out one step's moves; call ``advance(now)`` whenever time passes."""

    def __init__(self, actuator: Actuator, moves: tuple[Move, ...], now: float,
                 drain_timeout_s: float = math.inf, start_timeout_s: float = math.inf) -> None:
        self.actuator = actuator
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.forced_stops: list[tuple[str, int]] = []  # (slot, requests still in flight) of drains past their deadline
        self._progress = [_Progress(m, "draining", now) for m in moves]
        for item in self._progress:
            actuator.drain(item.move.slot, now)

    @property
    def done(self) -> bool:
        """Every move finished, one way or the other (see ``failed``)."""
        return all(p.phase in ("done", "failed") for p in self._progress)

    @property
    def failed(self) -> tuple[Move, ...]:
        """Moves whose slot did not become healthy within ``start_timeout_s``."""
        return tuple(p.move for p in self._progress if p.phase == "failed")

    def advance(self, now: float) -> None:
        act = self.actuator
        for item in self._progress:
            slot = item.move.slot
            if item.phase == "draining":
                in_flight = act.num_in_flight(slot)
                if in_flight and now - item.since >= self.drain_timeout_s:
                    self.forced_stops.append((slot, in_flight))
                if in_flight == 0 or now - item.since >= self.drain_timeout_s:
                    act.stop(slot, now)
                    act.start(slot, item.move.to_pool, item.move.config_json, now)
                    item.phase, item.since = "starting", now
            if item.phase == "starting":
                if act.is_healthy(slot, now):
                    act.activate(slot, now)
                    item.phase, item.since = "done", now
                elif now - item.since >= self.start_timeout_s:
                    item.phase, item.since = "failed", now
