"""Leader election for `polymorph controller` with a Kubernetes Lease (``fleet.controller.leader_election:
kubernetes``), as client-go's ``leaderelection`` does it:

- Every candidate reads the Lease (``coordination.k8s.io/v1``, ``fleet.controller.lease_name`` in
  ``fleet.kubernetes.namespace``) and ``decide``s: create it when it is absent, take it when it is released
  (no holder) or expired, renew it while it holds it, else wait. Expiry is judged on the candidate's own
  monotonic clock: a Lease expires ``leaseDurationSeconds`` after this candidate last SAW its record change,
  never by comparing the holder's ``renewTime`` with this host's wall clock, so clock skew between nodes
  does not matter.
- Every write is a replace carrying the read ``resourceVersion`` (or a create): of two candidates writing at
  once one gets ``409 Conflict`` (or ``AlreadyExists``), reads again and decides again.
- ``acquire`` blocks, polling every ``renew_every_s``; once it leads, a thread renews every ``renew_every_s``.
  If the Lease has another holder, or the leader could not renew it for ``lease_duration_s - renew_every_s``
  (client-go's renew deadline: before any standby can see it expire), the leader must stop acting at once:
  ``on_lost`` (by default: say why on stderr and exit 1, so Kubernetes restarts the pod as a standby).
- ``close`` (a clean exit) releases it: no holder, a one-second duration, so a standby takes over at its next
  poll instead of waiting out the lease.

The holder identity is the pod name (``HOSTNAME``, which Kubernetes sets to it) and the process id.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from fleet.actuators.kubernetes import _TRANSIENT, api_client
from gateway.config import ControllerSettingsFile

_MAX_CONFLICTS = 5  # 409s in one round before it counts as a failed round (someone keeps writing)


# --- the decision (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A Lease's spec as read: who holds it, for how long from its last renewal."""

    holder: str  # "" when released or never held
    renew_time: datetime | None  # only compared with the previous read, never with this host's clock
    duration_s: int
    transitions: int


@dataclass(frozen=True, slots=True)
class Observed:
    """The Lease as this candidate last read it (``record`` None: no Lease object) and, on this candidate's
    monotonic clock, when it first read that record."""

    record: LeaseRecord | None
    since_s: float


@dataclass(frozen=True, slots=True)
class LeaseDecision:
    action: Literal["create", "take", "renew", "wait"]
    holder: str  # the holder it found ("" when none)
    expires_in_s: float  # wait: until the holder's lease runs out on this candidate's clock; 0 otherwise


def observe(previous: Observed | None, record: LeaseRecord | None, now_s: float) -> Observed:
    """``record`` read at ``now_s``: an unchanged record keeps the time it was first seen."""
    if previous is not None and previous.record == record:
        return previous
    return Observed(record, now_s)


def decide(me: str, seen: Observed, now_s: float) -> LeaseDecision:
    """May ``me`` write the Lease it ``seen`` at ``now_s``? Renew what it holds; take what is released or
    unchanged for its whole duration; create what is absent; else wait."""
    record = seen.record
    if record is None:
        return LeaseDecision("create", "", 0.0)
    if record.holder == me:
        return LeaseDecision("renew", me, 0.0)
    left_s = seen.since_s + record.duration_s - now_s
    if not record.holder or left_s <= 0:
        return LeaseDecision("take", record.holder, 0.0)
    return LeaseDecision("wait", record.holder, left_s)


# --- the I/O edge ----------------------------------------------------------------------------------


def holder_identity() -> str:
    """The pod's name (Kubernetes sets HOSTNAME to it) and this process's id. A restarted container of the
    same pod may get the same one (pid 1): it then renews the Lease its dead predecessor held, rightly."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}_{os.getpid()}"


def exit_on_loss(why: str) -> None:
    """Stop acting at once: another controller leads or soon may. Exit non-zero so Kubernetes restarts the
    pod as a standby (client-go's leaders exit too); no cleanup, which would act as the leader."""
    print(f"polymorph: lost the controller's Lease: {why}; exiting so that this pod restarts as a standby", file=sys.stderr, flush=True)
    os._exit(1)


def _record(lease: k8s.V1Lease | None) -> LeaseRecord | None:
    if lease is None:
        return None
    spec = lease.spec or k8s.V1LeaseSpec()
    return LeaseRecord(spec.holder_identity or "", spec.renew_time, spec.lease_duration_seconds or 0, spec.lease_transitions or 0)


class LeaseContended(Exception):
    """The Lease changed under every write of a round (409 each time): someone else keeps writing it."""


def _why(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"the API server answered {exc.status} {exc.reason}"
    if isinstance(exc, LeaseContended):
        return str(exc)
    return f"the API server is unreachable ({type(exc).__name__})"


_FAILURES = (ApiException, LeaseContended, *_TRANSIENT)


class KubeLease:
    """This controller's leadership: ``acquire`` it, ``close`` it on a clean exit."""

    def __init__(self, settings: ControllerSettingsFile, namespace: str, kubeconfig: str | None, identity: str,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], datetime] = lambda: datetime.now(UTC),
                 on_lost: Callable[[str], None] = exit_on_loss) -> None:
        self.name = settings.lease_name
        self.namespace = namespace
        self.identity = identity
        self.duration_s = settings.lease_duration_s
        self.renew_every_s = settings.renew_every_s
        self.deadline_s = settings.lease_duration_s - settings.renew_every_s  # config.py keeps it >= renew_every_s
        self._api = k8s.CoordinationV1Api(api_client(kubeconfig))
        self._clock = clock
        self._wall = wall
        self._on_lost = on_lost
        self._seen: Observed | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"

    def acquire(self, on_wait: Callable[[str], None]) -> None:
        """Block until this process holds the Lease, then renew it in the background. ``on_wait`` hears why
        it waits (who holds the Lease, or what the API server answered) each time that changes."""
        said = ""
        while True:
            started_s = self._clock()
            try:
                decision = self._attempt(started_s + self.renew_every_s, leading=False)
                if decision.action != "wait":
                    break
                why = f"{decision.holder} holds the Lease {self.where}"
            except _FAILURES as exc:
                why = f"cannot take the Lease {self.where}: {_why(exc)}"
            if why != said:
                on_wait(why)
                said = why
            time.sleep(max(0.0, started_s + self.renew_every_s - self._clock()))
        self._renewer = threading.Thread(target=self._renew, args=(started_s,), name="lease-renewer", daemon=True)
        self._renewer.start()

    def close(self) -> None:
        """Stop renewing and release the Lease (if this process still holds it), so a standby takes over at
        its next poll, as client-go's ReleaseOnCancel does."""
        self._stop.set()
        if self._renewer is None:
            return
        self._renewer.join()
        try:
            until_s = self._clock() + self.renew_every_s
            lease = self._read(until_s)
            if lease is not None and lease.spec is not None and lease.spec.holder_identity == self.identity:
                self._write(lease, {"holder_identity": "", "lease_duration_seconds": 1, "renew_time": self._stamp()}, until_s)
        except _FAILURES as exc:
            print(f"polymorph: could not release the Lease {self.where} ({_why(exc)}); a standby takes over when it expires",
                  file=sys.stderr, flush=True)

    # -- rounds ------------------------------------------------------------------------------------

    def _renew(self, renewed_s: float) -> None:
        """Renew every ``renew_every_s``. No call runs past the renew deadline, so a leader that cannot renew
        stops acting before a standby can see its lease expire."""
        why = ""  # what the last failed try met
        while not self._stop.wait(self.renew_every_s):
            started_s = self._clock()
            if started_s < renewed_s + self.deadline_s:
                try:
                    decision = self._attempt(renewed_s + self.deadline_s, leading=True)
                except _FAILURES as exc:
                    why = _why(exc)
                else:
                    if decision.action == "renew":
                        renewed_s, why = started_s, ""
                        continue
                    self._on_lost(f"{decision.holder} holds the Lease {self.where} now" if decision.holder
                                  else f"the Lease {self.where} was {'deleted' if decision.action == 'create' else 'released'} by someone else")
                    return
            if self._clock() >= renewed_s + self.deadline_s:
                self._on_lost(f"could not renew the Lease {self.where} for {self._clock() - renewed_s:.1f} s ({why or 'no try finished'})")
                return

    def _attempt(self, until_s: float, leading: bool) -> LeaseDecision:
        """One read-decide-write round before ``until_s`` (reading again after each 409); returns the decision,
        carried out unless it is to wait, or, for a ``leading`` candidate, anything but a renewal (it lost)."""
        for _ in range(_MAX_CONFLICTS):
            lease = self._read(until_s)
            now_s = self._clock()
            self._seen = observe(self._seen, _record(lease), now_s)
            decision = decide(self.identity, self._seen, now_s)
            if decision.action == "wait" or (leading and decision.action != "renew"):
                return decision
            stamp = self._stamp()
            renewal: dict[str, Any] = {"holder_identity": self.identity, "lease_duration_seconds": self.duration_s, "renew_time": stamp}
            try:
                if lease is None:
                    self._api.create_namespaced_lease(self.namespace, k8s.V1Lease(
                        api_version="coordination.k8s.io/v1", kind="Lease", metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                        spec=k8s.V1LeaseSpec(**renewal, acquire_time=stamp, lease_transitions=0)), _request_timeout=self._timeout(until_s))
                elif decision.action == "take":
                    transitions = self._seen.record.transitions + 1 if self._seen.record is not None else 0
                    self._write(lease, {**renewal, "acquire_time": stamp, "lease_transitions": transitions}, until_s)
                else:
                    self._write(lease, renewal, until_s)
                return decision
            except ApiException as exc:
                if exc.status != 409:  # 409: another candidate wrote first (Conflict) or created it (AlreadyExists)
                    raise
        raise LeaseContended(f"409 Conflict {_MAX_CONFLICTS} times in a row")

    def _timeout(self, until_s: float) -> float:
        return max(0.05, until_s - self._clock())

    def _read(self, until_s: float) -> k8s.V1Lease | None:
        try:
            return self._api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self._timeout(until_s))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _write(self, lease: k8s.V1Lease, changes: dict[str, Any], until_s: float) -> None:
        """Replace ``lease`` as read (its resourceVersion the precondition) with these spec fields changed."""
        spec = (lease.spec or k8s.V1LeaseSpec()).model_copy(update=changes)
        self._api.replace_namespaced_lease(self.name, self.namespace, lease.model_copy(update={"spec": spec}),
                                           _request_timeout=self._timeout(until_s))

    def _stamp(self) -> datetime:
        """Now, for renewTime and acquireTime. The client writes ``datetime.isoformat()``, which leaves out a
        zero fraction of a second that the API server's MicroTime parser requires: never a whole second."""
        now = self._wall()
        return now if now.microsecond else now.replace(microsecond=1)
