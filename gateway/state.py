"""The one mutable object behind the app: the current runtime and the long-lived helpers around it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp

from fleet.decisions import DecisionLog
from fleet.health import HealthState
from fleet.replica_outcomes import ReplicaOutcomes
from gateway.accesslog import AccessLog
from gateway.config import GatewayConfig
from gateway.decision_metrics import DecisionMetrics
from gateway.metrics import GatewayMetrics
from gateway.runtime import Runtime, build_runtime
from gateway.series import Series
from gateway.upstream import UpstreamPool
from kernels.yamlsrc import load_yaml

if TYPE_CHECKING:
    from gateway.proxy import Proxy

# the `fleet:` settings a running control loop was built from (GatewayConfig field = its key under fleet)
_FLEET_FIELDS = ("pools", "devices", "emulator_speed", "controller", "actuator", "ray", "kubernetes")


class TelemetrySink(Protocol):
    def record_arrival(self, now: float, shape: str, tier: str, prompt_tokens: int, model: str) -> None: ...  # model: the served one
    def record_outcome(self, now: float, shape: str, pool: str, met_slo: bool, completion_tokens: int, model: str,
                       cached_tokens: int = 0, of_prompt_tokens: int = 0) -> None: ...


class FleetLink(Protocol):
    """The control loop as the request path sees it: the embedded one (gateway.live_fleet.LiveFleet),
    the link to an external controller (gateway.plan_client.PlanClient), either of which owns the pools,
    or the capacity model of ``urls`` pools (gateway.pool_modeller.PoolModeller), which does not."""

    @property
    def telemetry(self) -> TelemetrySink: ...
    @property
    def owns_pools(self) -> bool: ...  # True: a config reload keeps the pools (the loop made them)
    def now(self) -> float: ...
    def replica_process(self, name: str) -> dict[str, object] | None: ...  # a launched replica's command line and devices
    def start_loop(self) -> None: ...
    async def stop_loop(self) -> None: ...


class GatewayState:
    """The current runtime (swapped whole on reload) and what outlives it: metrics, series, decisions, pools."""

    def __init__(self, config: GatewayConfig, replica_urls: dict[str, list[str]]) -> None:
        self.replica_urls = replica_urls
        self.metrics = GatewayMetrics()
        self.runtime: Runtime = build_runtime(config, self.urls_for(config), None, time.monotonic())
        self._publish_runtime()
        self.access_log = AccessLog() if config.server.access_log else None
        self.series = Series()
        self.decisions = DecisionLog()
        self.metrics.registry.register(DecisionMetrics(self.decisions))  # the embedded controller's (--workers 1)
        self.replica_outcomes = ReplicaOutcomes()  # per replica, on the fleet clock: what canary trials compare
        self.started_at = time.time()
        self.session: aiohttp.ClientSession | None = None  # probes and model discovery only
        self.upstream_pool: UpstreamPool | None = None
        self.proxy: Proxy | None = None
        self.live: FleetLink | None = None  # the control loop, when fleet.controller is enabled

    def urls_for(self, config: GatewayConfig) -> dict[str, list[str]]:
        """Static URLs from the config plus the replicas an actuator started for each pool."""
        return {p.name: [*p.urls, *self.replica_urls.get(p.name, [])] for p in config.pools}

    def apply(self, config: GatewayConfig) -> Runtime:
        """Swap in a new config version; in-flight requests keep the runtime they started with. Raises
        ConfigError, naming the field's line, for a change of the fleet a control loop owns: its pools were
        made from the first version, and the rest of a version checked against pools it would not get (an
        alias of a model no running pool serves) must not be half applied."""
        if self.live is not None and self.live.owns_pools:
            changed = next((name for name in _FLEET_FIELDS if getattr(config, name) != getattr(self.runtime.config, name)), None)
            if changed is not None:
                raise load_yaml(Path(config.source)).error(
                    ("fleet", changed), "the fleet is the control loop's while the gateway runs: a change here takes effect on restart "
                                        "(revert it to apply the rest of this version)")
        runtime = build_runtime(config, self.urls_for(config), self.runtime, asyncio.get_running_loop().time())
        if self.live is not None and self.live.owns_pools:  # the controller owns the pools now; the config seeded them
            runtime = dataclasses.replace(runtime, pools=self.runtime.pools, replica_by_name=self.runtime.replica_by_name)
        upstream = config.upstream
        for pool in runtime.pools:  # replicas kept from the last version (all, when the controller owns them) guard by the new settings
            for replica in pool.replicas:
                replica.breaker.configure(upstream.eject_after_failures, upstream.eject_cooldown_s)
        self.runtime = runtime
        if self.proxy is not None:  # waiting requests move to the new pools' queues; new replicas may take some
            self.proxy.waits.attach(runtime, asyncio.get_running_loop().time())
        self._publish_runtime()
        return self.runtime

    def _publish_runtime(self) -> None:
        self.metrics.config_version.set(self.runtime.version)
        for pool in self.runtime.pools:
            for replica in pool.replicas:
                healthy = replica.breaker.state is HealthState.HEALTHY
                self.metrics.child(self.metrics.replica_up, pool.name, replica.name).set(1 if healthy else 0)


