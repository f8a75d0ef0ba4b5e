"""What the controller asks of whoever owns the replicas: frozen commands, applied at the edge.

``Controller.tick`` returns them in a ``TickOutput`` and never acts, as vLLM's scheduler
returns an output that the executor applies: the live gateway applies them on its event loop (the
pools' only writer), the external controller on its tick thread, the simulator in virtual time.
What happened comes back as the next tick's facts (``fleet.rollout.SlotState``: alive, in flight,
healthy), never through a call back into the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fleet.decisions import Decision


@dataclass(frozen=True, slots=True)
class Drain:
    """Route nothing new to ``slot``; its in-flight requests go on."""

    slot: str


@dataclass(frozen=True, slots=True)
class Stop:
    """End ``slot``'s engine (SIGTERM, then SIGKILL after a grace) and take it out of its pool."""

    slot: str


@dataclass(frozen=True, slots=True)
class Start:
    """Start ``slot``'s engine with ``config_json`` for ``pool`` on the slot's devices; not routable yet."""

    slot: str
    pool: str
    config_json: str


@dataclass(frozen=True, slots=True)
class Activate:
    """``slot`` answered ``/health``: routable in its (new) pool."""

    slot: str


Command = Drain | Stop | Start | Activate


@dataclass(frozen=True, slots=True)
class TickOutput:
    """One tick's result (the controller's, the operator's moves', the canary trials'): decisions to log,
    commands for the edge to apply (in order)."""

    decisions: list[Decision]
    commands: list[Command]


class Actuator(Protocol):
    """Whoever owns the replicas; each call returns at once (a start's health is a later tick's fact)."""

    def drain(self, slot: str, now: float) -> None: ...
    def stop(self, slot: str, now: float) -> None: ...
    def start(self, slot: str, pool: str, config_json: str, now: float) -> None: ...
    def activate(self, slot: str, now: float) -> None: ...


def apply(commands: Iterable[Command], actuator: Actuator, now: float) -> None:
    """Carry ``commands`` out in order: one dispatcher for every edge."""
    for command in commands:
        match command:
            case Drain(slot):
                actuator.drain(slot, now)
            case Stop(slot):
                actuator.stop(slot, now)
            case Start(slot, pool, config_json):
                actuator.start(slot, pool, config_json, now)
            case Activate(slot):
                actuator.activate(slot, now)
