"""Prometheus metrics with bounded label sets: tenant, tier, pool, replica and shape names all come from
the config, never from request text (unknown callers are counted under tenant ``_unauthenticated``).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.exposition import generate_latest

# `polymorph serve --workers N` sets this before starting the workers: each worker then writes its
# samples to shared files and any worker's /metrics reports the sum over all of them.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# What generate_latest writes: the text exposition format 0.0.4, which every Prometheus reads
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class GatewayMetrics:
    """All of the gateway's series, with labelled children cached so the hot path does one dict lookup."""

    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("polymorph_requests", "Requests answered, by tenant, tier, pool and HTTP status.", ["tenant", "tier", "pool", "status"], registry=r)
        self.ttft = Histogram("polymorph_ttft_seconds", "Time to first byte of the response body from the replica.", ["tier", "pool"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("polymorph_tpot_seconds", "Time per output token after the first (streaming).", ["tier", "pool"], buckets=_TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("polymorph_request_duration_seconds", "End-to-end request time in the gateway.", ["tier", "pool"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.in_flight = Gauge("polymorph_requests_in_flight", "Requests being proxied now, by pool.", ["pool"], registry=r, multiprocess_mode="livesum")
        self.retries = Counter("polymorph_upstream_retries", "Requests retried on another replica before the first byte.", ["pool"], registry=r)
        self.ejections = Counter("polymorph_replica_ejections", "Replicas ejected by the circuit breaker.", ["pool", "replica"], registry=r)
        self.rejections = Counter("polymorph_rejections", "Requests refused by the gateway, by reason.", ["tenant", "reason"], registry=r)
        self.shapes = Counter("polymorph_classified", "Requests classified, by shape and domain.", ["shape", "domain"], registry=r)
        self.replica_up = Gauge("polymorph_replica_healthy", "1 when the replica takes traffic, 0 when ejected.", ["pool", "replica"], registry=r, multiprocess_mode="livemin")
        self.tenant_cost = Counter("polymorph_tenant_cost_usd", "GPU cost of tenants' requests in USD: each request's share of its replica's engine time at its pool's price.", ["tenant", "pool"], registry=r)
        self.budget_remaining = Gauge("polymorph_tenant_budget_remaining_usd", "What is left of a tenant's monthly budget this period (tenants with a budget).", ["tenant"], registry=r, multiprocess_mode="livemin")
        self.tokens = Counter("polymorph_tokens", "Tokens in usage reports, by tenant and kind (prompt, completion).", ["tenant", "kind"], registry=r)
        self.reloads = Counter("polymorph_config_reloads", "Config reload attempts, by result (applied, rejected).", ["result"], registry=r)
        self.config_version = Gauge("polymorph_config_version", "Number of the config version being served.", registry=r, multiprocess_mode="livemax")
        self.queue_depth = Gauge("polymorph_pool_queue_depth", "Requests waiting in a pool's queue for a replica's room, by pool and tier.", ["pool", "tier"], registry=r, multiprocess_mode="livesum")
        self.queue_waits = Counter("polymorph_pool_queue_waits", "Requests parked in a pool's queue because its replicas were full.", ["pool", "tier"], registry=r)
        self.queue_sheds = Counter("polymorph_pool_queue_sheds", "Waiting requests shed with 429, by reason (deadline: it passed; full: the queue was).", ["pool", "tier", "reason"], registry=r)
        self.queue_wait = Histogram("polymorph_pool_queue_wait_seconds", "Time a request waited in its pool's queue before a replica took it.", ["pool", "tier"], buckets=_LATENCY_BUCKETS_S, registry=r)
        # Requests held while every replica of their model restarts (gateway.restart_waits).
        self.restart_held = Gauge("polymorph_restart_held", "Requests held now because every replica serving their model is restarting.", ["pool", "tier"], registry=r, multiprocess_mode="livesum")
        self.restart_holds = Counter("polymorph_restart_holds", "Requests held while their model's replicas restarted, by outcome (released, deadline, full, gone).", ["pool", "tier", "outcome"], registry=r)
        # Each replica engine's own figures, as the gateway last read them from its /metrics (gateway.engine_scrape).
        replica = ["pool", "replica"]
        self.engine_running = Gauge("polymorph_engine_requests_running", "Requests the replica's engine is computing, at its last /metrics scrape.", replica, registry=r, multiprocess_mode="livemax")
        self.engine_waiting = Gauge("polymorph_engine_requests_waiting", "Requests queued inside the replica's engine, at its last /metrics scrape.", replica, registry=r, multiprocess_mode="livemax")
        self.engine_kv_usage = Gauge("polymorph_engine_kv_cache_usage_ratio", "Share of the replica engine's KV cache in use (engines that export it).", replica, registry=r, multiprocess_mode="livemax")
        self.engine_prefix_hits = Gauge("polymorph_engine_prefix_cache_hit_ratio", "Share of the prompt tokens looked up in the engine's prefix cache between two scrapes that it held.", replica, registry=r, multiprocess_mode="livemax")
        self.engine_up = Gauge("polymorph_engine_metrics_up", "1 when the replica engine's /metrics was read at the last scrape, 0 when not (it is then routed by the gateway's own counts).", replica, registry=r, multiprocess_mode="livemax")
        self.engine_scrape_failures = Counter("polymorph_engine_scrape_failures", "Scrapes of a replica engine's /metrics that failed (unreachable, timed out, not 200, or no load metrics).", replica, registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}
        self._latency_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def child(self, family: Any, *labels: str) -> Any:
        key = (id(family), *labels)
        found = self._children.get(key)
        if found is None:
            found = family.labels(*labels)
            self._children[key] = found
        return found

    def drop(self, family: Any, *labels: str) -> None:
        """Stop exporting ``family``'s child of ``labels`` (a figure no longer known), if it was exported."""
        if self._children.pop((id(family), *labels), None) is not None:
            family.remove(*labels)

    def latencies(self, tier: str, pool: str) -> tuple[Any, Any, Any]:
        """The e2e, TTFT and TPOT histograms of ``tier`` on ``pool``, found with one lookup."""
        found = self._latency_children.get((tier, pool))
        if found is None:
            found = self._latency_children[(tier, pool)] = (
                self.child(self.e2e, tier, pool), self.child(self.ttft, tier, pool), self.child(self.tpot, tier, pool)
            )
        return found

    def count_request(self, tenant: str, tier: str, pool: str, status: int) -> None:
        self.child(self.requests, tenant, tier, pool, _status_text(status)).inc()

    def reject(self, tenant: str, reason: str) -> None:
        self.child(self.rejections, tenant, reason).inc()

    def render(self) -> bytes:
        if self.multiprocess:
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)


_STATUS_TEXT = {code: str(code) for code in range(100, 600)}


def _status_text(status: int) -> str:
    return _STATUS_TEXT.get(status, "other")
