"""`polymorph controller` elects its leader with a Kubernetes Lease (``fleet.controller.leader_election:
kubernetes``): the pure decision, the election itself with the real ``kubernetes`` client against the test
API server (tests/support/kube_api.py), and two real controller processes taking over from each other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is not installed: pip install -e '.[kubernetes]' (make test installs it)")

from gateway.config import ControllerSettingsFile, load_config  # noqa: E402
from gateway.kube_lease import KubeLease, LeaseRecord, Observed, decide, observe  # noqa: E402
from kernels.yamlsrc import ConfigError  # noqa: E402
from loadtest.chaos.controller_faults import ExternalControllerDeployment  # noqa: E402
from loadtest.chaos.fleet_faults import write_fleet_config  # noqa: E402
from loadtest.chaos.stack import POLYMORPH, wait_until  # noqa: E402
from tests.support.kube_api import KubeApi  # noqa: E402

LEASE = "polymorph-controller"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _record(holder: str, renewed: datetime = T0, duration_s: int = 10) -> LeaseRecord:
    return LeaseRecord(holder, renewed, duration_s, 0)


# --- the decision ------------------------------------------------------------------------------------


def test_a_candidate_creates_an_absent_lease_renews_its_own_takes_a_released_or_expired_one_and_waits_otherwise() -> None:
    assert decide("me", Observed(None, 0.0), 0.0).action == "create"
    assert decide("me", Observed(_record("me"), 0.0), 100.0).action == "renew"  # held by me: renew, however late
    assert decide("me", Observed(_record(""), 5.0), 5.0).action == "take"  # released
    waiting = decide("me", Observed(_record("other"), 5.0), 9.0)
    assert (waiting.action, waiting.holder, waiting.expires_in_s) == ("wait", "other", 6.0)
    assert decide("me", Observed(_record("other"), 5.0), 14.9).action == "wait"
    assert decide("me", Observed(_record("other"), 5.0), 15.0).action == "take"  # expired on my clock


def test_expiry_counts_from_when_this_candidate_saw_the_record_change_not_from_the_holders_renew_time() -> None:
    # the holder's clock is a day behind ours: its renewTime looks ancient, yet it renews, so it holds
    skewed = observe(None, _record("other", T0 - timedelta(days=1)), 100.0)
    assert decide("me", skewed, 101.0).action == "wait"
    renewed = observe(skewed, _record("other", T0 - timedelta(days=1) + timedelta(seconds=2)), 108.0)
    assert renewed.since_s == 108.0 and decide("me", renewed, 112.0).action == "wait"  # 4 s after the renewal, not 12 s after the first read
    # a holder whose clock runs a day ahead but which stopped renewing: expired one duration after its record last changed
    ahead = observe(None, _record("other", T0 + timedelta(days=1)), 100.0)
    unchanged = observe(ahead, _record("other", T0 + timedelta(days=1)), 109.0)
    assert unchanged.since_s == 100.0 and decide("me", unchanged, 109.0).action == "wait"
    assert decide("me", unchanged, 110.0).action == "take"


def test_the_election_settings_are_validated_with_their_line(tmp_path: Path) -> None:
    def load(controller: dict[str, Any]) -> ControllerSettingsFile:
        path = write_fleet_config(tmp_path, (("mixed", 1, ("short-chat",)),), {"enabled": True, "mode": "external", "url": "http://127.0.0.1:1", **controller})
        path.write_text(json.dumps(json.loads(path.read_text()), indent=1))  # a line per field, for the errors to name
        return load_config(path).controller

    settings = load({})
    assert (settings.leader_election, settings.lease_name, settings.lease_duration_s, settings.renew_every_s) == ("file", LEASE, 15, 5.0)
    assert load({"leader_election": "kubernetes", "lease_duration_s": 3, "renew_every_s": 1.5}).leader_election == "kubernetes"
    for bad, says in (({"leader_election": "etcd"},  "leader_election"), ({"lease_name": "Not_A_Name"}, "lease_name"),
                      ({"lease_duration_s": 2.5}, "lease_duration_s"), ({"lease_duration_s": 10, "renew_every_s": 6}, "renew_every_s"),
                      ({"leader_election": "kubernetes", "mode": "embedded"}, "leader_election")):
        with pytest.raises(ConfigError) as raised:
            load(bad)
        assert re.match(rf".*config\.yaml:\d+: fleet\.controller\.{says}: ", str(raised.value)), raised.value


# --- the election against the test API server ----------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[KubeApi, Path]]:
    server = KubeApi(tmp_path / "pods")
    server.start()
    try:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        server.close()


class _Candidate:
    """A KubeLease whose loss is recorded instead of ending the test process."""

    def __init__(self, api: KubeApi, kubeconfig: Path, identity: str, duration_s: int = 2, renew_every_s: float = 0.25) -> None:
        settings = ControllerSettingsFile(mode="external", leader_election="kubernetes", lease_duration_s=duration_s, renew_every_s=renew_every_s)
        self.lost: list[str] = []
        self.waits: list[str] = []
        self.leading = threading.Event()
        self.lease = KubeLease(settings, api.namespace, str(kubeconfig), identity, on_lost=self.lost.append)

    def campaign(self) -> threading.Thread:
        def run() -> None:
            self.lease.acquire(self.waits.append)
            self.leading.set()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def _spec(api: KubeApi) -> dict[str, Any]:
    lease = api.lease(LEASE)
    assert lease is not None
    return lease["spec"]  # type: ignore[no-any-return]


def test_one_candidate_leads_the_other_waits_and_takes_over_at_once_when_the_leader_releases(api: tuple[KubeApi, Path]) -> None:
    server, kubeconfig = api
    a, b = _Candidate(server, kubeconfig, "a", duration_s=30), _Candidate(server, kubeconfig, "b")
    a.campaign().join(10)
    assert a.leading.is_set() and _spec(server)["holderIdentity"] == "a" and _spec(server)["leaseDurationSeconds"] == 30
    b.campaign()
    wait_until("b to wait", lambda: bool(b.waits), 10)
    assert b.waits[0] == f"a holds the Lease {server.namespace}/{LEASE}"
    first = _spec(server)["renewTime"]
    wait_until("a to renew", lambda: _spec(server)["renewTime"] != first, 10)
    assert not b.leading.is_set() and _spec(server)["holderIdentity"] == "a"
    a.lease.close()
    wait_until("b to take the released Lease", b.leading.is_set, 5)  # not a's 30 s
    spec = _spec(server)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1 and spec["leaseDurationSeconds"] == 2
    b.lease.close()
    assert _spec(server)["holderIdentity"] == "" and not a.lost and not b.lost


def test_a_dead_leaders_lease_is_taken_once_it_expires_and_conflicts_on_renewal_are_read_again(api: tuple[KubeApi, Path]) -> None:
    server, kubeconfig = api
    a, b = _Candidate(server, kubeconfig, "a"), _Candidate(server, kubeconfig, "b")
    a.campaign().join(10)
    server.conflict_next_lease_write(3)  # the next three renewals each find the Lease changed under them
    wait_until("the conflicts to be served", lambda: server.lease_conflicts == 3, 10)
    renewed = _spec(server)["renewTime"]
    wait_until("a to renew after them", lambda: _spec(server)["renewTime"] != renewed, 10)
    assert not a.lost and _spec(server)["holderIdentity"] == "a"
    b.campaign()
    wait_until("b to wait", lambda: bool(b.waits), 10)
    a.lease._stop.set()  # a dies without releasing: its lease lapses
    wait_until("b to take the expired Lease", b.leading.is_set, 10)
    assert _spec(server)["holderIdentity"] == "b" and not b.lost
    b.lease.close()


def test_a_leader_that_loses_its_lease_or_the_api_server_says_so(api: tuple[KubeApi, Path]) -> None:
    server, kubeconfig = api
    a = _Candidate(server, kubeconfig, "a")
    a.campaign().join(10)
    server.write_lease(LEASE, {"holderIdentity": "intruder"})
    wait_until("a to notice", lambda: bool(a.lost), 10)
    assert a.lost == [f"intruder holds the Lease {server.namespace}/{LEASE} now"]
    server.write_lease(LEASE, {"holderIdentity": "", "leaseDurationSeconds": 1})
    b = _Candidate(server, kubeconfig, "b")
    b.campaign().join(10)
    server.outage(5.0)
    wait_until("b to give up", lambda: bool(b.lost), 10)
    assert b.lost[0].startswith(f"could not renew the Lease {server.namespace}/{LEASE} for ") and "unreachable" in b.lost[0], b.lost
    assert _spec(server)["holderIdentity"] == "b"  # it never released: it must not act once it may have lost


def test_an_outage_refuses_connections_and_keeps_the_port_from_other_servers(api: tuple[KubeApi, Path]) -> None:
    server, _ = api
    server.outage(2.0)
    wait_until("the port to refuse", lambda: server.refusing, 5)
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.connect(("127.0.0.1", server.port))
    with socket.socket() as probe, pytest.raises(OSError):  # as free_port probes: it must not hand the port to another server,
        probe.bind(("127.0.0.1", server.port))  # whose 404s for the Lease's path read as "deleted by someone else"
    wait_until("the outage to end", lambda: not server.down, 5)


# --- two real `polymorph controller` processes ---------------------------------------------------------


def _configure(deployment: ExternalControllerDeployment, kubeconfig: Path, name: str, duration_s: int) -> Path:
    """A copy of the deployment's config electing with the Lease, held ``duration_s`` from each renewal."""
    doc = json.loads(deployment.config.read_text())
    doc["fleet"]["controller"].update({"leader_election": "kubernetes", "lease_duration_s": duration_s, "renew_every_s": 0.5})
    doc["fleet"]["kubernetes"] = {"namespace": "polymorph", "kubeconfig": str(kubeconfig)}
    path = deployment.run_dir / name
    path.write_text(json.dumps(doc))
    return path


def test_controllers_elect_with_a_lease_a_killed_leader_is_replaced_when_it_expires_a_stopped_one_at_once(
        api: tuple[KubeApi, Path], tmp_path: Path) -> None:
    server, kubeconfig = api
    with ExternalControllerDeployment(tmp_path / "run") as deployment:
        deployment.run_dir.mkdir(parents=True, exist_ok=True)
        short, long = _configure(deployment, kubeconfig, "short.json", 3), _configure(deployment, kubeconfig, "long.json", 60)

        def start(name: str, config: Path) -> subprocess.Popen[bytes]:
            return deployment.registry.start(name, [*POLYMORPH, "controller", "--config", str(config), "--replica-logs",
                                                    str(deployment.run_dir / "replicas"), "--stop-replicas-on-exit"],
                                             env={**os.environ, "PYTHONUNBUFFERED": "1", "HOSTNAME": name})

        def holder() -> str:
            lease = server.lease(LEASE)
            return str(lease["spec"].get("holderIdentity") or "") if lease else ""

        a = start("controller-a", short)  # leads with a 3 s lease
        deployment.wait_leading(a)
        assert holder() == f"controller-a_{a.pid}"
        b = start("controller-b", long)  # leads with a 60 s lease once it does
        wait_until("b to stand by", lambda: "standby: controller-a_" in deployment.log("controller-b"), 60)
        server.conflict_next_lease_write(2)
        wait_until("a's renewals to meet the conflicts", lambda: server.lease_conflicts >= 2, 10)
        time.sleep(1.0)  # a few renew periods: a keeps leading through them
        assert a.poll() is None and holder() == f"controller-a_{a.pid}"

        a.send_signal(signal.SIGKILL)  # no release: b takes over once a's 3 s lease expires on b's clock
        wait_until("b to lead", lambda: holder() == f"controller-b_{b.pid}", 3 + 0.5 + 10)
        deployment.wait_leading(b)
        assert "resuming from" in deployment.log("controller-b")

        c = start("controller-c", long)
        wait_until("c to stand by", lambda: "standby: controller-b_" in deployment.log("controller-c"), 60)
        b.send_signal(signal.SIGTERM)  # a clean exit releases b's 60 s lease: c need not wait it out
        assert b.wait(30) == 0
        wait_until("c to lead", lambda: holder() == f"controller-c_{c.pid}", 20)
        deployment.wait_leading(c)

        server.write_lease(LEASE, {"holderIdentity": "intruder"})  # someone else holds it now: c stops acting at once
        assert c.wait(10) == 1
        assert "lost the controller's Lease: intruder holds the Lease" in deployment.log("controller-c")
