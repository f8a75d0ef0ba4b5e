"""Passive health: a circuit breaker per replica. Pure state machine; the caller passes the clock."""

from __future__ import annotations

from enum import Enum


class HealthState(Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"  # failing: no traffic until the cool-down has passed
    PROBING = "probing"  # cool-down over: one trial (a request or an active probe) decides


class CircuitBreaker:
    """Ejects a replica after ``eject_after`` consecutive failures, for ``cooldown_s``, then probes it."""

    __slots__ = ("eject_after", "cooldown_s", "state", "consecutive_failures", "ejected_at", "num_ejections", "num_trials")

    def __init__(self, eject_after: int, cooldown_s: float) -> None:
        self.eject_after = eject_after
        self.cooldown_s = cooldown_s
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.ejected_at = 0.0
        self.num_ejections = 0
        self.num_trials = 0

    def configure(self, eject_after: int, cooldown_s: float) -> None:
        """New settings (a config reload) for the replica it guards; its state and count stay."""
        self.eject_after = eject_after
        self.cooldown_s = cooldown_s

    def available(self, now: float) -> bool:
        """May a request go here now? Once an ejection's cool-down is over, exactly one trial may."""
        if self.state is HealthState.HEALTHY:
            return True
        return self.state is HealthState.EJECTED and now - self.ejected_at >= self.cooldown_s

    def on_dispatch(self) -> int | None:
        """A request is being sent: if this is the trial after a cool-down, hold others back until it ends.
        Returns the trial's number (None: not a trial), for ``on_undecided``."""
        if self.state is HealthState.EJECTED:
            self.state = HealthState.PROBING
            self.num_trials += 1
            return self.num_trials
        return None

    def on_undecided(self, trial: int | None) -> None:
        """Trial ``trial`` ended with neither a success nor a failure (its client left first, or the replica
        answered 429): it decided nothing, so the next request or probe is the trial. Without this the replica
        would stay out for good: nothing is sent to a replica whose trial is in flight, probes included."""
        if trial is not None and trial == self.num_trials and self.state is HealthState.PROBING:
            self.state = HealthState.EJECTED

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.state = HealthState.HEALTHY

    def on_failure(self, now: float) -> bool:
        """Record a failure; True when this failure ejects the replica."""
        self.consecutive_failures += 1
        if self.state is HealthState.PROBING or (
            self.state is HealthState.HEALTHY and self.consecutive_failures >= self.eject_after
        ):
            self.state = HealthState.EJECTED
            self.ejected_at = now
            self.num_ejections += 1
            return True
        return False
