"""What a request cost: its share of its replica's engine time (fleet.engine_share) at its pool's price.

A config pool's price per replica-hour (gateway.config.replica_price_per_hour_usd, which the runtime
holds for each) is ``price_per_hour_usd`` from its config entry, else the catalog's
``price_per_gpu_hour`` of its ``gpu`` times the devices one replica holds. The pools the controller
creates (``<shape>@<gpu>``) are priced by the capacity model's figure (the same catalog price times
their GPUs per replica) or, before a plan sized them, one GPU's catalog price. A pool of ``urls``
with no ``gpu`` and no price costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels.catalog import get_gpu

if TYPE_CHECKING:
    from gateway.runtime import Runtime


def pool_price_per_hour_usd(runtime: Runtime, pool: str) -> float:
    price = runtime.price_per_hour_usd.get(pool)
    if price is not None:
        return price
    state = next((p for p in runtime.pools if p.name == pool), None)
    if state is None or state.gpu is None:
        return 0.0
    return state.cost_per_hour if state.cost_per_hour > 0 else get_gpu(state.gpu).price_per_gpu_hour


def request_cost_usd(runtime: Runtime, pool: str, engine_share_s: float) -> float:
    """The cost of ``engine_share_s`` wall seconds of a replica of ``pool``: emulated replicas run
    ``emulator_speed`` GPU-seconds per wall second, and are charged those."""
    if engine_share_s <= 0.0:
        return 0.0
    return engine_share_s * runtime.time_scale(pool) * pool_price_per_hour_usd(runtime, pool) / 3600.0
