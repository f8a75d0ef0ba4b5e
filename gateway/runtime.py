"""Everything the request path reads, derived from one config version and swapped in whole on reload.

Live facts (replica health and load, tenants' rate-limit buckets) are carried over from the previous
runtime wherever the config did not change them, so a reload never resets a tenant's budget or
re-admits an ejected replica.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from classifiers.request import RequestClassifier
from fleet.health import CircuitBreaker
from fleet.pool import PoolState, ReplicaState
from gateway.adapters import adapter_bases
from gateway.admission import Limiter, TenantLimiter
from gateway.budgets import SharedSpendLedger, SpendBook, SpendLedger
from gateway.budgets_store import StoreSpendLedger
from gateway.config import GatewayConfig, Tenant, replica_price_per_hour_usd
from gateway.limits_shared import SharedTenantLimiter, attached_table, num_local_workers
from gateway.limits_store import LimitStore, StoreTenantLimiter
from kernels.catalog import get_gpu
from kernels.config import EngineConfig
from kernels.engine_servers import running_by_default

DEFAULT_MAX_RUNNING_PER_REPLICA = 256


@dataclass(frozen=True, slots=True)
class Runtime:
    config: GatewayConfig
    version: int
    tenant_by_key_hash: Mapping[str, Tenant]
    limiters: Mapping[str, Limiter]
    classifier: RequestClassifier
    pools: tuple[PoolState, ...]
    replica_by_name: Mapping[str, ReplicaState]
    real_pools: frozenset[str]  # config pools of real replicas (URLs, real engines): their latencies are wall time
    limit_store: LimitStore | None = None  # limits.store: the tenants' limits live there (read at start; kept across reloads)
    spend: SpendBook = field(default_factory=SpendLedger)  # tenants' spend this budget period (gateway.budgets; kept across reloads)
    price_per_hour_usd: Mapping[str, float] = field(default_factory=dict)  # a config pool's replica price (gateway.costs)
    adapter_base: Mapping[str, str] = field(default_factory=dict)  # LoRA adapter name -> its base model (gateway.adapters)

    def served_models(self) -> list[str]:
        models: set[str] = set()
        for pool in self.pools:
            if pool.models is not None:
                models |= pool.models
            for replica in pool.replicas:
                if replica.models:
                    models |= replica.models
        return sorted(models)

    def time_scale(self, pool: str | None) -> float:
        """Seconds of fleet time per wall second on ``pool``'s replicas: emulated GPUs run at
        ``fleet.emulator_speed`` (so do the pools the controller creates); real replicas at 1."""
        return 1.0 if pool in self.real_pools else self.config.emulator_speed


def max_running_per_replica(config: EngineConfig, engine_kind: str, gpu: str | None) -> int:
    """Requests in flight at which a replica counts as saturated: the running requests its engine
    configuration sets, else what its engine runs on ``gpu`` when that is unset (kernels.engine_servers:
    llama-server's slots, vLLM's sequences for the device); sglang sizes its batch from memory, which
    the gateway does not know: the default."""
    device = None if gpu is None else get_gpu(gpu)
    return config.max_running_requests or running_by_default(engine_kind, device, config.tp) or DEFAULT_MAX_RUNNING_PER_REPLICA


def _build_pools(
    config: GatewayConfig, replica_urls: Mapping[str, Sequence[str]], previous: Runtime | None
) -> tuple[PoolState, ...]:
    old_by_url = {(r.pool, r.url): r for p in previous.pools for r in p.replicas} if previous else {}
    pools = []
    for spec in config.pools:
        discover = spec.model == "*"
        pool = PoolState(
            name=spec.name,
            models=None if discover else frozenset({spec.model, *spec.adapter_names}),  # a request naming an adapter goes where it is loaded
            shapes=frozenset(spec.shapes),
            gpu=spec.gpu,
            max_running_per_replica=spec.max_in_flight_per_replica or max_running_per_replica(EngineConfig.from_dict(spec.engine), spec.engine_kind, spec.gpu),
            declared_limit=spec.max_in_flight_per_replica is not None,
            engine_kind=spec.engine_kind,
            priority_scheduling=spec.engine.get("schedule_policy") == "priority",
        )
        for i, url in enumerate(replica_urls.get(spec.name, spec.urls)):
            old = old_by_url.get((spec.name, url))
            if old is not None:
                pool.replicas.append(old)
                continue
            pool.replicas.append(
                ReplicaState(
                    name=f"{spec.name}-{i}",
                    url=url,
                    pool=spec.name,
                    breaker=CircuitBreaker(config.upstream.eject_after_failures, config.upstream.eject_cooldown_s),
                    models=frozenset() if discover else None,
                    affinity_salt=zlib.crc32(url.encode()),
                )
            )
        pools.append(pool)
    return tuple(pools)


def _build_limiters(config: GatewayConfig, previous: Runtime | None, now: float) -> tuple[LimitStore | None, dict[str, Limiter]]:
    """Each tenant's limiter: kept from ``previous`` while its limits are the same; else a new one in the
    store (limits.store), in this host's shared table (``--workers`` > 1) or in this process (the default)."""
    if previous is not None:
        store = previous.limit_store
    else:
        store = LimitStore(config.limits, num_local_workers()) if config.limits.store is not None else None
    table = attached_table()
    limiters: dict[str, Limiter] = {}
    for tenant in config.tenants:
        old = previous.limiters.get(tenant.name) if previous else None
        if old is not None and (old.tenant.requests_per_min, old.tenant.tokens_per_min) == (tenant.requests_per_min, tenant.tokens_per_min):
            old.retarget(tenant)
            limiters[tenant.name] = old
        elif store is not None:
            limiters[tenant.name] = StoreTenantLimiter(store, tenant, now)
        elif table is not None:
            limiters[tenant.name] = SharedTenantLimiter(table, tenant, now)
        else:
            limiters[tenant.name] = TenantLimiter(tenant, now)
    if store is not None:
        store.limiters = {name: lim for name, lim in limiters.items() if isinstance(lim, StoreTenantLimiter)}
    return store, limiters


def _spend_book(config: GatewayConfig, previous: Runtime | None, limit_store: LimitStore | None, now: float) -> SpendBook:
    """The spend carried over from ``previous``, or a new ledger: in the limits store (limits.store), in this
    host's shared table with ``--workers`` > 1, else in the process."""
    if limit_store is not None:  # the store is chosen at start and kept across reloads: so is its ledger
        return previous.spend if previous is not None else StoreSpendLedger(limit_store)
    table = attached_table()
    if table is not None:  # the figures live in the table; the new tenants need their rows
        return SharedSpendLedger(table, config.tenants, now)
    return previous.spend if previous is not None else SpendLedger()


def build_runtime(
    config: GatewayConfig,
    replica_urls: Mapping[str, Sequence[str]],
    previous: Runtime | None,
    now: float,
) -> Runtime:
    """Derive a runtime from ``config``. Raises ClassifierLoadError if the classifier cannot load."""
    by_key = {h: t for t in config.tenants for h in t.key_sha256}
    limit_store, limiters = _build_limiters(config, previous, now)
    if previous is not None and previous.config.classifier == config.classifier:
        classifier = previous.classifier.with_rules(config.shapes)
    else:
        classifier = RequestClassifier.load(config.classifier.model, config.classifier.tokenizer, config.shapes)
    pools = _build_pools(config, replica_urls, previous)
    return Runtime(
        config=config,
        version=previous.version + 1 if previous else 1,
        tenant_by_key_hash=by_key,
        limiters=limiters,
        classifier=classifier,
        pools=pools,
        replica_by_name={r.name: r for pool in pools for r in pool.replicas},
        real_pools=frozenset(spec.name for spec in config.pools if spec.real),
        limit_store=limit_store,
        spend=_spend_book(config, previous, limit_store, now),
        price_per_hour_usd={spec.name: replica_price_per_hour_usd(spec) for spec in config.pools},
        adapter_base=adapter_bases(config.pools),
    )
