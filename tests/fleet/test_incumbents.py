"""A pool whose replicas run a configuration keeps it unless a candidate earns back their restarts."""

from __future__ import annotations

from fleet.capacity import Capacity
from fleet.incumbents import restart_margin, running_configs
from fleet.options import config_json, pool_options
from fleet.rollout import SlotState
from fleet.telemetry import ShapeLoad
from kernels.config import EngineConfig
from kernels.tiers import DEFAULT_TIERS

GPU = "H100-SXM"
SMALL_CHUNKS = EngineConfig(chunked_prefill_size=2048)


class DefaultsFaster:
    """sglang's defaults ``gain`` faster than every other configuration (a small chunk size here)."""

    def __init__(self, gain: float) -> None:
        self.gain = gain

    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: object) -> Capacity:
        rate = 10.0 * (1 + self.gain) if config == EngineConfig() else 10.0
        return Capacity(rate, rate * 2)


CHAT = ShapeLoad("chat", 5.0, 800.0, 200.0, (("interactive", 1.0),))


def _config(gain: float, running: dict[str, EngineConfig] | None, margin: float) -> EngineConfig:
    options = pool_options((CHAT,), (GPU,), DefaultsFaster(gain), DEFAULT_TIERS, running=running, restart_margin=margin)
    return dict(options.pool_to_config)["chat@H100-SXM"]


def test_a_running_pool_restarts_only_for_a_gain_that_pays_for_the_restart() -> None:
    margin = restart_margin(48.0, 900.0)  # 20 s drain + 28 s restart out of the 900 s horizon: 5.3%
    running = {"chat@H100-SXM": SMALL_CHUNKS}
    assert _config(0.04, running, margin) == SMALL_CHUNKS  # 4% faster: its replicas would lose more restarting
    assert _config(0.08, running, margin) == EngineConfig()  # 8%: worth the restart
    # no replicas run it (a new pool): nothing restarts, the fastest wins as before
    assert _config(0.04, None, margin) == EngineConfig()
    assert _config(0.04, {"other@H100-SXM": SMALL_CHUNKS}, margin) == EngineConfig()


def test_running_configs_reads_each_pools_single_live_configuration() -> None:
    slots = [
        SlotState("H100-SXM/0", "chat@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/1", "chat@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/2", "code@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/3", "code@H100-SXM", GPU, "{}"),  # mid-rollout: two configurations
        SlotState("H100-SXM/4", "gone@H100-SXM", GPU, "{}", alive=False),
    ]
    assert running_configs(slots) == {"chat@H100-SXM": SMALL_CHUNKS}
