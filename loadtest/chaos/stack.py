"""A real deployment to break: emulated replicas and one gateway, each its own process on loopback.

Replicas listen on fixed ports, so a killed one can be restarted where the gateway expects it and
be readmitted by the health probes. The config and tenant files are plain files on disk, so a
scenario can replace them under load exactly as an operator would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench.processes import tree_rss_mb
from loadtest.procs import ProcessRegistry, free_port, wait_http

POLYMORPH = (sys.executable, "-m", "gateway.cli")
STARTUP_TIMEOUT_S = 60.0  # a gateway loads its classifier; replicas beside a busy test run start slowly


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """One pool of emulated replicas; ``shapes`` empty makes it an overflow-only pool."""

    name: str
    model: str
    num_replicas: int
    shapes: tuple[str, ...] = ("short-chat", "long-context", "reasoning", "batch")
    engine: Mapping[str, Any] = field(default_factory=dict)
    gpu: str = "H100-SXM"
    speed: float = 20.0
    external_urls: tuple[str, ...] = ()  # replicas this stack does not start (e.g. a GarbageReplica)


@dataclass(frozen=True, slots=True)
class TenantPlan:
    name: str
    api_key: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StackPlan:
    pools: tuple[PoolPlan, ...]
    tenants: tuple[TenantPlan, ...]
    upstream: Mapping[str, Any]
    admin_token: str = "chaos-admin-token"
    max_body_bytes: int = 65536


@dataclass(slots=True)
class Replica:
    pool: str
    index: int
    port: int
    argv: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"  # the gateway names replicas of a pool's URL list this way


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


class ChaosStack:
    """Start with ``start()``; every process is ended by ``stop()`` (or leaving the ``with`` block)."""

    def __init__(self, plan: StackPlan, run_dir: Path) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.registry = ProcessRegistry(run_dir)
        self.replicas: dict[str, list[Replica]] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_port = free_port()
        self.config_path = run_dir / "config.yaml"
        self.tenants_dir = run_dir / "tenants"

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> ChaosStack:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for pool in self.plan.pools:
            engine = json.dumps(dict(pool.engine))
            self.replicas[pool.name] = [
                Replica(pool.name, i, free_port(), (*POLYMORPH, "emulate", "--model", pool.model, "--gpu", pool.gpu,
                                                    "--config", engine, "--speed", f"{pool.speed:g}",
                                                    "--served-model-name", pool.model))
                for i in range(pool.num_replicas)
            ]
        for replicas in self.replicas.values():
            for replica in replicas:
                self._launch(replica)
        for replicas in self.replicas.values():
            for replica in replicas:
                assert replica.process is not None
                wait_http(replica.url + "/health", replica.process, STARTUP_TIMEOUT_S)
        self.write_config()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.gateway = self.registry.start(
            "gateway", [*POLYMORPH, "serve", "--config", str(self.config_path), "--port", str(self.gateway_port)], env=env
        )
        wait_http(self.url + "/readyz", self.gateway, STARTUP_TIMEOUT_S)
        return self

    def stop(self) -> None:
        self.registry.stop_all()

    def __enter__(self) -> ChaosStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, replica: Replica) -> None:
        replica.process = self.registry.start(f"{replica.name}", [*replica.argv, "--port", str(replica.port)])

    # -- files --------------------------------------------------------------------------------

    def config_text(self) -> str:
        pools = [
            {"name": p.name, "model": p.model, "shapes": list(p.shapes), "engine": dict(p.engine),
             "replicas": {"urls": [*(r.url for r in self.replicas[p.name]), *p.external_urls]}}
            for p in self.plan.pools
        ]
        config = {
            "server": {"host": "127.0.0.1", "admin_token": self.plan.admin_token, "max_body_bytes": self.plan.max_body_bytes},
            "upstream": dict(self.plan.upstream),
            "tenants_dir": "tenants",
            "fleet": {"pools": pools},
        }
        return json.dumps(config, indent=1)  # JSON is YAML

    def tenant_text(self, tenant: TenantPlan) -> str:
        digest = hashlib.sha256(tenant.api_key.encode()).hexdigest()
        return json.dumps({"name": tenant.name, "api_key_sha256": [digest], **tenant.fields})

    def write_config(self) -> None:
        self.tenants_dir.mkdir(exist_ok=True)
        for tenant in self.plan.tenants:
            (self.tenants_dir / f"{tenant.name}.yaml").write_text(self.tenant_text(tenant))
        self.config_path.write_text(self.config_text())

    # -- faults -------------------------------------------------------------------------------

    def replica(self, pool: str, index: int) -> Replica:
        return self.replicas[pool][index]

    def set_faults(self, pool: str, index: int, **faults: object) -> None:
        replica = self.replica(pool, index)
        request = urllib.request.Request(replica.url + "/_emulator/faults", data=json.dumps(faults).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        deadline_at = time.monotonic() + 5.0
        while True:  # a replica refusing connections takes its new faults once it listens again
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    resp.read()
                return
            except urllib.error.URLError:
                if time.monotonic() > deadline_at:
                    raise
                time.sleep(0.05)

    def reset_faults(self) -> None:
        for replicas in self.replicas.values():
            for replica in replicas:
                if replica.process is not None and replica.process.poll() is None:
                    self.set_faults(replica.pool, replica.index, reset=True)

    def kill_replica(self, pool: str, index: int) -> None:
        """SIGKILL: no goodbye, open connections reset, exactly like a crashed host process."""
        process = self.replica(pool, index).process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)

    def restart_replica(self, pool: str, index: int) -> None:
        """Start it again on the same port (after a kill or a crash exit) and wait until it is healthy."""
        replica = self.replica(pool, index)
        if replica.process is not None and replica.process.poll() is None:
            return
        self._launch(replica)
        assert replica.process is not None
        wait_http(replica.url + "/health", replica.process, STARTUP_TIMEOUT_S)

    # -- observing the gateway ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def gateway_alive(self) -> bool:
        return self.gateway is not None and self.gateway.poll() is None

    def gateway_rss_mb(self) -> float:
        return tree_rss_mb(self.gateway.pid) if self.gateway is not None else 0.0

    def gateway_log(self) -> str:
        return (self.run_dir / "gateway.log").read_text(errors="replace")

    def admin_state(self) -> dict[str, Any]:
        status, body = http_get(self.url + "/admin/state", {"Authorization": f"Bearer {self.plan.admin_token}"})
        if status != 200:
            raise RuntimeError(f"/admin/state answered {status}: {body[:200]!r}")
        return json.loads(body)  # type: ignore[no-any-return]

    def replica_health(self, pool: str, index: int) -> str:
        name = self.replica(pool, index).name
        for p in self.admin_state()["pools"]:
            for r in p["replicas"]:
                if r["name"] == name:
                    return str(r["health"])
        raise KeyError(name)

    def wait_readmitted(self, pool: str, index: int, timeout_s: float) -> float | None:
        """Seconds until the gateway calls the replica healthy again, or None if it never did."""
        started_at = time.monotonic()
        while time.monotonic() - started_at < timeout_s:
            if self.replica_health(pool, index) == "healthy":
                return time.monotonic() - started_at
            time.sleep(0.05)
        return None

    def metric(self, name: str, label_filter: str = "") -> float:
        return metric_sum(self.url, name, label_filter)


def metric_sum(gateway_url: str, name: str, label_filter: str = "") -> float:
    """Sum of the samples of ``name`` whose label text contains ``label_filter``."""
    _, body = http_get(gateway_url + "/metrics")
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", body.decode(), re.M):
        if label_filter in (match.group(1) or ""):
            total += float(match.group(2))
    return total


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll ``check`` every 0.1 s until it holds; TimeoutError naming ``what`` after ``timeout_s``. A check
    that cannot ask (a process between leaders or restarting: OSError, RuntimeError) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, RuntimeError):
            if check():
                return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")
