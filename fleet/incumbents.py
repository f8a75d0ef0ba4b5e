"""What each pool's replicas run now, and what replacing it must gain (pure).

An in-place recompile restarts every replica of a pool that stays: each is out for a drain and a
restart. ``pool_options`` keeps a pool's running configuration unless a candidate is faster by
``restart_margin``: the share of the plan's horizon one restart takes, so a replica's gain over
the horizon pays for its own outage. drift-ramp used to restart both short-chat replicas for a 2%
edge, in steps of their own, each verified for 45 s, while the ramp went on (fleet/README.md
"Capacity at SLO").
"""

from __future__ import annotations

from collections.abc import Iterable

from fleet.rollout import SlotState, parsed_config
from kernels.config import EngineConfig


def running_configs(slots: Iterable[SlotState]) -> dict[str, EngineConfig]:
    """Each pool's configuration, for the pools whose live replicas all run the same one (a pool
    mid-rollout with two has no single incumbent, and one whose JSON does not parse has none; one
    configuration spelled two ways is one)."""
    pool_to_configs: dict[str, set[EngineConfig | None]] = {}
    for slot in slots:
        if slot.alive:
            pool_to_configs.setdefault(slot.pool, set()).add(parsed_config(slot.config_json))
    out: dict[str, EngineConfig] = {}
    for pool, found in pool_to_configs.items():
        config = next(iter(found))
        if len(found) == 1 and config is not None:
            out[pool] = config
    return out


def restart_margin(move_s: float, horizon_s: float) -> float:
    """The speed-up a replica needs to earn back its drain and restart within the plan's horizon."""
    return move_s / horizon_s
