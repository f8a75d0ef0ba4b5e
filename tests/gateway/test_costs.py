"""Pool prices and a request's cost (gateway.costs): the config's override, else the catalog's GPU price
times the GPUs of one replica; the controller's <shape>@<gpu> pools by their GPU kind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.pool import PoolState
from gateway.config import load_config
from gateway.costs import pool_price_per_hour_usd, request_cost_usd
from gateway.runtime import build_runtime
from kernels.catalog import get_gpu
from tests.support.procs import write_tenant


def test_prices_come_from_the_override_or_the_catalog_times_the_gpus_of_a_replica(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "t", "sk-test-costs")
    pools = [
        {"name": "one", "model": "llama-3.1-8b", "gpu": "H100-SXM", "replicas": {"emulated": 1}},
        {"name": "two", "model": "llama-3.1-8b", "gpu": "H100-SXM", "engine": {"tp": 2}, "replicas": {"emulated": 1}},
        {"name": "priced", "model": "llama-3.1-8b", "gpu": "H100-SXM", "price_per_hour_usd": 7.2, "replicas": {"emulated": 1}},
        {"name": "remote", "model": "llama-3.1-8b", "replicas": {"urls": ["http://127.0.0.1:9"]}},
    ]
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"tenants_dir": "tenants", "fleet": {"pools": pools, "emulator_speed": 10.0}}))
    runtime = build_runtime(load_config(path), {}, None, 0.0)
    h100 = get_gpu("H100-SXM").price_per_gpu_hour
    assert h100 > 0
    assert [pool_price_per_hour_usd(runtime, name) for name in ("one", "two", "priced", "remote")] == pytest.approx([h100, 2 * h100, 7.2, 0.0])
    # emulated replicas are charged their GPU-seconds: emulator_speed of them per wall second; real ones wall time
    assert request_cost_usd(runtime, "priced", 0.5) == pytest.approx(0.5 * 10.0 * 7.2 / 3600)
    assert request_cost_usd(runtime, "remote", 0.5) == 0.0
    # a pool the controller created: the capacity model's price once a plan sized it, else one GPU's
    created = PoolState("short-chat@H100-SXM", frozenset({"llama-3.1-8b"}), frozenset({"short-chat"}), "H100-SXM", 64)
    runtime = dataclasses.replace(runtime, pools=(*runtime.pools, created))  # as gateway.live_fleet.swap_pools publishes it
    assert pool_price_per_hour_usd(runtime, created.name) == pytest.approx(h100)
    created.cost_per_hour = 4 * h100
    assert pool_price_per_hour_usd(runtime, created.name) == pytest.approx(4 * h100)
