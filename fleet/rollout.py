"""Act: turn a plan diff into moves, batch them, and carry each move out drain-first.

``diff_moves`` decides which replica slots (a slot is one replica's GPUs, of one kind) change pool
or configuration; ``batch_moves`` cuts them into steps of at most ``max_fraction`` of the fleet
(``rolling_batches`` also restarts one replica of a pool at a time); a
``Mover`` plans a step's commands (fleet.commands) from the facts each tick brings: drain (the router
sends the slot nothing new), wait until its in-flight requests have finished, stop, start with the
new configuration, wait for health, and only then activate it in its new pool. Nothing is aborted,
so no request is dropped by a move. The Mover never acts: the simulator's virtual fleet, the
gateway's event loop and the external controller apply the same commands.

Both waits have deadlines. A drain that outlasts ``drain_timeout_s`` stops the slot anyway (the
requests still on it end with a clear error instead of holding the rollout forever); a start that
is not healthy within ``start_timeout_s``, or whose process exits first, fails the move, and the
controller rolls the step back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.commands import Activate, Command, Drain, Start, Stop
from fleet.decisions import Move
from fleet.engines.load import EngineLoad
from kernels.config import EngineConfig


@dataclass(frozen=True, slots=True)
class SlotState:
    """One replica slot as the edge saw it when the tick's snapshot was taken."""

    slot: str
    pool: str
    gpu: str
    config_json: str
    alive: bool = True  # False: its replica process is gone (or ejected for long); its GPUs serve nothing
    num_in_flight: int = 0  # requests on it (what a drain waits for)
    healthy: bool = True  # the engine its latest Start began answers /health
    engine: EngineLoad | None = None  # its engine's own figures at the last /metrics scrape (None: not read)


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
            if not same_config(wanted, slot.config_json):
                moves.append(Move(slot.slot, slot.pool, slot.pool, wanted))
    return moves


def same_config(a: str, b: str) -> bool:
    """Two configurations' JSON are one configuration: a canary's adopted one is spelled as the operator's
    declared JSON is, a plan's as ``fleet.options.config_json``; restarting a replica into its own
    configuration would only lose its cache."""
    if a == b:
        return True
    parsed = parsed_config(a)
    return parsed is not None and parsed == parsed_config(b)


def parsed_config(text: str) -> EngineConfig | None:
    """A slot's configuration JSON as an ``EngineConfig`` (None: it does not parse)."""
    try:
        return EngineConfig.from_dict(json.loads(text))
    except (ValueError, TypeError):
        return None


def batch_moves(moves: list[Move], fleet_size: int, max_fraction: float) -> list[tuple[Move, ...]]:
    """Steps of at most ``max_fraction`` of the fleet (at least one move each)."""
    size = max(1, math.floor(max_fraction * fleet_size))
    return [tuple(moves[i : i + size]) for i in range(0, len(moves), size)]


def rolling_batches(recompiles: list[Move], fleet_size: int, max_fraction: float) -> list[tuple[Move, ...]]:
    """In-place recompiles in steps of at most ``max_fraction`` of the fleet and one replica per pool (a
    rolling restart: the pool's other replicas carry its demand meanwhile). A pool near its capacity
    that loses two of three replicas at once queues twice the backlog and takes longer than twice as
    long to clear it: drift-step stretched, 30 req/s on 8 GPUs, restarted two of three short-chat
    replicas at once and fell to 64% SLO attainment in that half-minute (fleet/README.md)."""
    size = max(1, math.floor(max_fraction * fleet_size))
    steps: list[list[Move]] = []
    for move in recompiles:
        step = next((s for s in steps if len(s) < size and all(m.from_pool != move.from_pool for m in s)), None)
        if step is None:
            steps.append([move])
        else:
            step.append(move)
    return [tuple(step) for step in steps]


@dataclass(slots=True)
class _Progress:
    move: Move
    phase: str  # "new", "draining", "starting", then "done" or "failed" (never became healthy)
    since: float


class Mover:
    """Plans one step's moves; call ``advance(now, slots)`` whenever time passes and apply what it returns.

    A fact read in the tick that issued a command is stale for it: the slot drained in this tick is
    checked for in-flight requests from the next one on, the slot started in this tick for health
    from the next one on (the edge applies the commands before it takes the next snapshot)."""

    def __init__(self, moves: tuple[Move, ...], now: float,
                 drain_timeout_s: float = math.inf, start_timeout_s: float = math.inf) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.forced_stops: list[tuple[str, int]] = []  # (slot, requests still in flight) of drains past their deadline
        self._progress = [_Progress(m, "new", now) for m in moves]

    @property
    def done(self) -> bool:
        """Every move finished, one way or the other (see ``failed``)."""
        return all(p.phase in ("done", "failed") for p in self._progress)

    @property
    def failed(self) -> tuple[Move, ...]:
        """Moves whose slot did not become healthy within ``start_timeout_s`` (or whose process exited first)."""
        return tuple(p.move for p in self._progress if p.phase == "failed")

    def advance(self, now: float, slots: Mapping[str, SlotState]) -> list[Command]:
        out: list[Command] = []
        for item in self._progress:
            move = item.move
            fact = slots.get(move.slot)
            if item.phase == "new":
                out.append(Drain(move.slot))
                item.phase, item.since = "draining", now
            elif item.phase == "draining":
                in_flight = fact.num_in_flight if fact is not None else 0
                overdue = now - item.since >= self.drain_timeout_s
                if in_flight and overdue:
                    self.forced_stops.append((move.slot, in_flight))
                if in_flight == 0 or overdue:
                    out += [Stop(move.slot), Start(move.slot, move.to_pool, move.config_json)]
                    item.phase, item.since = "starting", now
            elif item.phase == "starting":
                if fact is not None and fact.alive and fact.healthy:
                    out.append(Activate(move.slot))
                    item.phase, item.since = "done", now
                elif (fact is not None and not fact.alive) or now - item.since >= self.start_timeout_s:
                    item.phase, item.since = "failed", now  # its process exited, or it outran its deadline
        return out
