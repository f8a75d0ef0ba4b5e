"""The controller's plan counts a client that loads the replicas directly, live: the gateway scrapes the
emulated engines, hands their figures to the controller with its snapshot, and the plan decision says
what share of the pool's capacity the foreign requests held."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.test_live_fleet import ADMIN, KEY, _admin, _traffic
from tests.support.procs import start_gateway, write_tenant

SPEED = 20.0
MODEL = "llama-3.1-8b"
NUM_FOREIGN_PER_REPLICA = 16


def _plan(url: str) -> dict[str, Any] | None:
    decisions: list[dict[str, Any]] = _admin(url, "/admin/decisions")["decisions"]  # type: ignore[assignment]
    return next((d for d in decisions if d["kind"] == "plan"), None)


async def _foreign(replica_urls: list[str], stop: asyncio.Event) -> int:
    """NUM_FOREIGN_PER_REPLICA long requests on each replica, straight to its engine, renewed until ``stop``."""
    done = 0

    async def worker(client: openai.AsyncOpenAI) -> None:
        nonlocal done
        while not stop.is_set():
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
                                                 max_tokens=1500, extra_body={"ignore_eos": True})
            done += 1

    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-the-gateway", max_retries=0, timeout=120) for url in replica_urls]
    await asyncio.gather(*(worker(client) for client in clients for _ in range(NUM_FOREIGN_PER_REPLICA)))
    for client in clients:
        await client.close()
    return done


async def _scenario(url: str, replica_urls: list[str]) -> tuple[list[int], int]:
    """Foreign load from the start; the gateway's own short chats until the controller has planned."""
    stop = asyncio.Event()
    foreign = asyncio.create_task(_foreign(replica_urls, stop))
    await asyncio.sleep(3.0)  # a window (120 fleet s = 6 s) mostly under foreign load by the time the plan comes
    statuses: list[int] = []
    deadline = time.monotonic() + 120.0  # a re-plan consults the performance model: seconds of CPU, more on a busy machine
    while time.monotonic() < deadline:
        statuses += await _traffic(url, duration_s=2.0, rate_rps=10.0)
        if await asyncio.to_thread(_plan, url) is not None:
            break
    stop.set()
    return statuses, await foreign


@pytest.mark.slow
def test_the_plan_decision_counts_a_client_that_loads_the_replicas_directly(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "live", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "upstream": {"engine_metrics_interval_s": 0.2},
        "fleet": {
            "pools": [{"name": "mixed", "model": MODEL, "gpu": "H100-SXM", "shapes": ["short-chat"], "replicas": {"emulated": 2}}],
            "emulator_speed": SPEED,
            "controller": {"enabled": True, "tick_s": 5.0},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    try:
        pools = {p["name"]: p for p in _admin(gateway.url, "/admin/state")["pools"]}  # type: ignore[union-attr]
        replica_urls = [r["url"] for r in pools["mixed"]["replicas"]]
        statuses, num_foreign_done = asyncio.run(_scenario(gateway.url, replica_urls))
        plan = _plan(gateway.url)
        kinds = [d["kind"] for d in _admin(gateway.url, "/admin/decisions")["decisions"]]  # type: ignore[union-attr]
        pools = {p["name"]: p for p in _admin(gateway.url, "/admin/state")["pools"]}  # type: ignore[union-attr]
    finally:
        gateway.stop()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert plan is not None and num_foreign_done > 0, kinds
    share = plan["evidence"].get("foreign_share", {}).get("mixed")
    concurrency = pools["mixed"]["max_running_per_replica"]  # the plan's, rounded up: what the share is of
    # 16 requests per replica kept in flight, less the gaps between one and the next; without them the
    # share is absent (the gateway's own requests cancel out in the window mean)
    assert share is not None and share >= 0.5 * NUM_FOREIGN_PER_REPLICA / concurrency, (share, concurrency)
