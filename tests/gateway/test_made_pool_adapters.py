"""A pool the controller makes (``<shape>@<gpu>``) loads the LoRA adapters of its model's declared pools and
is routed for them, as the declared pools holding them are (gateway.replicas.made_pool_engine, gateway.live_fleet.new_pool)."""

from __future__ import annotations

from pathlib import Path

from gateway.config import load_config
from gateway.live_fleet import new_pool
from gateway.replicas import launcher, made_pool_engine
from tests.gateway.test_lora import ADAPTERS, BASE, _config, _pool

EMULATE = ("polymorph", "emulate")


def test_a_pool_the_controller_makes_loads_and_serves_its_models_adapters(tmp_path: Path) -> None:
    # the first declared pool (whose engine a made pool runs) holds no adapter; another pool of the model does
    config = load_config(_config(tmp_path, [_pool("plain"), _pool("tuned", adapters=ADAPTERS)]))
    engine_json = '{"max_running_requests": 32}'
    argv = launcher(config, EMULATE)("H100-SXM", "long-context@H100-SXM", engine_json, ()).argv
    loaded = {argv[i + 1] for i, arg in enumerate(argv) if arg == "--adapter"}
    assert loaded == {f"{name}={path}" for name, path in ADAPTERS.items()}
    engine = made_pool_engine(config, "long-context@H100-SXM", "H100-SXM")
    assert engine is not None and engine.adapter_names == set(ADAPTERS)
    pool = new_pool("long-context@H100-SXM", BASE, "H100-SXM", engine_json, engine)
    assert pool.serves("sql-lora") and pool.serves("chat-lora") and pool.serves(BASE) and not pool.serves("poetry-lora")
    # a declared pool keeps its own: the plain one launches none
    plain = launcher(config, EMULATE)("H100-SXM", "plain", engine_json, ()).argv
    assert "--adapter" not in plain
