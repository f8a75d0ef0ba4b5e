"""Moves an operator asks for (``POST /admin/move``), carried out the way the controller carries out a step.

One move at a time, through the same ``Mover``: drain the replica (no new requests; those in flight
finish, or are cut at ``drain_timeout_s``), stop it, start it with the target pool's configuration on
the same devices, wait until it answers ``/health`` and a warm-up request, and only then route to it
in its new pool. A start that does not become healthy within ``start_timeout_s`` is rolled back: the
replica goes back to its previous pool and configuration the same way. Every phase is a decision-log
entry (``step``, ``verify``, ``rollback``, with ``source: operator``) holding its evidence.

Like the controller, it decides and never acts: ``request`` and ``tick`` return a ``TickOutput`` whose
commands the edge applies before it takes the next snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.commands import Activate, Command, Stop, TickOutput
from fleet.decisions import Decision, Move
from fleet.evidence import RollbackEvidence, StepEvidence, VerifyEvidence
from fleet.rollout import Mover, SlotState


class MoveRefused(ValueError):
    """The move cannot start: ``status`` is the HTTP status an API answers with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class _Operation:
    move: Move
    old_config_json: str
    mover: Mover
    requested_at: float
    rolling_back: bool = False
    in_flight_at_drain: int = 0
    stopped_at: float | None = None
    healthy_at: float | None = None
    reason: str = ""
    evidence: dict[str, object] = field(default_factory=dict)


class OperatorMoves:
    def __init__(self, drain_timeout_s: float = 300.0, start_timeout_s: float = 900.0) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self._op: _Operation | None = None

    @property
    def busy(self) -> bool:
        return self._op is not None

    @property
    def moving(self) -> str | None:
        """The replica being moved (or moved back)."""
        return self._op.move.slot if self._op is not None else None

    def request(self, now: float, slots: list[SlotState], replica: str, to_pool: str, config_json: str,
                to_gpu: str | None = None) -> TickOutput:
        """Begin moving ``replica`` into ``to_pool`` (whose device kind is ``to_gpu``; None: the pool names
        none) with ``config_json``. Raises ``MoveRefused``."""
        if self._op is not None:
            raise MoveRefused(409, f"replica {self._op.move.slot} is being moved; one move at a time")
        by_name = {s.slot: s for s in slots}
        found = by_name.get(replica)
        if found is None:
            raise MoveRefused(404, f"no replica named {replica!r} is launched by this gateway")
        if not found.alive:
            raise MoveRefused(409, f"replica {replica!r} is not running")
        if to_gpu is not None and found.gpu != to_gpu:  # both catalog names (gateway.config reads them so)
            # a replica restarts on its own devices: an H100 replica in an H200 pool would run the H200
            # pool's configuration (memory fraction, batch caps) on an H100, and every plan would count it
            # as an H200. The controller's own moves never cross kinds (fleet.rollout.diff_moves).
            raise MoveRefused(409, f"replica {replica!r} runs on {found.gpu} and pool {to_pool!r} on {to_gpu}; "
                                   "a replica moves only into a pool of its own device kind")
        if found.pool == to_pool and found.config_json == config_json:
            raise MoveRefused(409, f"replica {replica!r} already serves in {to_pool!r} with that configuration")
        move = Move(replica, found.pool, to_pool, config_json)
        mover = Mover((move,), now, self.drain_timeout_s, self.start_timeout_s)
        self._op = _Operation(move, found.config_json, mover, now, in_flight_at_drain=found.num_in_flight)
        step = Decision(now, StepEvidence(source="operator", reason="operator move (POST /admin/move)", from_config=found.config_json,
                                          to_config=config_json, in_flight_at_drain=found.num_in_flight), (move,))
        return TickOutput([step], self._advance(now, by_name))

    def tick(self, now: float, slots: list[SlotState]) -> TickOutput:
        op = self._op
        if op is None:
            return TickOutput([], [])
        commands = self._advance(now, {s.slot: s for s in slots})
        if not op.mover.done:
            return TickOutput([], commands)
        return TickOutput(self._finish(now, op), commands)

    def _advance(self, now: float, slots: Mapping[str, SlotState]) -> list[Command]:
        op = self._op
        assert op is not None
        commands = op.mover.advance(now, slots)
        for command in commands:
            if isinstance(command, Stop):
                op.stopped_at = now
            elif isinstance(command, Activate):
                op.healthy_at = now
        return commands

    def _finish(self, now: float, op: _Operation) -> list[Decision]:
        mover, move = op.mover, op.move
        drain_s, start_to_healthy_s = _round(op.stopped_at, op.requested_at), _round(op.healthy_at, op.stopped_at)
        forced = tuple(mover.forced_stops)
        if op.rolling_back:
            self._op = None
            outcome = "failed" if mover.failed else "restored"
            return [Decision(now, RollbackEvidence(
                source="operator", outcome=outcome, drain_s=drain_s, start_to_healthy_s=start_to_healthy_s, drain_deadline_stops=forced,
                reason="the previous configuration never became healthy either" if mover.failed
                else "the replica serves again in its previous pool with its previous configuration"), (move,))]
        if mover.failed:
            undo = move.reversed(op.old_config_json)
            self._op = _Operation(undo, move.config_json, Mover((undo,), now, self.drain_timeout_s, self.start_timeout_s), now,
                                  rolling_back=True)
            return [Decision(now, RollbackEvidence(
                source="operator", reason="replica never became healthy", start_timeout_s=self.start_timeout_s, never_healthy=(move.slot,),
                drain_s=drain_s, start_to_healthy_s=start_to_healthy_s, drain_deadline_stops=forced), (undo,))]
        self._op = None
        return [Decision(now, VerifyEvidence(source="operator", ok=True, healthy=True, warmed_up=True, drain_s=drain_s,
                                             start_to_healthy_s=start_to_healthy_s, drain_deadline_stops=forced, config=move.config_json),
                         (move,))]


def _round(end: float | None, start: float | None) -> float | None:
    return round(end - start, 3) if end is not None and start is not None else None

