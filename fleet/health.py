"""Passive health: a circuit breaker per replica. Pure state machine; the caller passes the clock."""

from __future__ import annotations

import math
from enum import Enum


class HealthState(Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"  # failing: no traffic until the cool-down has passed
    PROBING = "probing"  # cool-down over: one trial (a request or an active probe) decides


class CircuitBreaker:
    """Ejects a replica after ``eject_after`` consecutive failures, for ``cooldown_s``, then probes it.

    A request's success ends a run of failures; so does a quiet ``cooldown_s`` (a failure is held against
    a replica as long as an ejection would keep it out). A health probe's 200 readmits an ejected replica
    (it is the trial) but does not clear a healthy one's failures: /health answers for the process, not
    for the generate path, and a model that fails every request keeps a healthy HTTP server. Before, each
    probe cleared the count, so a replica sent fewer than ``eject_after`` requests per probe interval was
    never ejected, and each of its requests paid a retry."""

    __slots__ = (
        "eject_after", "cooldown_s", "state", "consecutive_failures", "ejected_at", "num_ejections", "num_trials",
        "last_failure_at",
    )

    def __init__(self, eject_after: int, cooldown_s: float) -> None:
        self.eject_after = eject_after
        self.cooldown_s = cooldown_s
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.ejected_at = 0.0
        self.num_ejections = 0
        self.num_trials = 0
        self.last_failure_at = -math.inf

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

    def failures(self, now: float) -> int:
        """The failures held against the replica now: its current run's (0 once a quiet cool-down ended it)."""
        if self.state is HealthState.HEALTHY and now - self.last_failure_at > self.cooldown_s:
            return 0
        return self.consecutive_failures

    def on_success(self) -> None:
        """A request succeeded (or a probe readmits): the run of failures is over."""
        self.consecutive_failures = 0
        self.state = HealthState.HEALTHY

    def on_probe_success(self, trial: int | None) -> bool:
        """/health answered 200 to the probe ``on_dispatch`` numbered ``trial``; True when that readmits the
        replica: only the trial of an ejected one does. A probe sent while the replica was healthy decides
        nothing, even when requests ejected it while the probe was in flight: its 200 predates their
        failures (it readmitted the replica 0.1 s probes apart, under load, in tests/gateway/test_probe_failures.py)."""
        if trial is None or trial != self.num_trials or self.state is not HealthState.PROBING:
            return False
        self.on_success()
        return True

    def on_failure(self, now: float) -> bool:
        """Record a failure; True when this failure ejects the replica."""
        # A quiet cool-down ended the earlier run; an ejected replica's count goes on (live_fleet reads it).
        self.consecutive_failures = self.failures(now) + 1
        self.last_failure_at = now
        if self.state is HealthState.PROBING or (
            self.state is HealthState.HEALTHY and self.consecutive_failures >= self.eject_after
        ):
            self.state = HealthState.EJECTED
            self.ejected_at = now
            self.num_ejections += 1
            return True
        return False
