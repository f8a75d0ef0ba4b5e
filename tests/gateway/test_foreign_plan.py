"""The controller's plan counts a client that loads the replicas directly, live: the gateway (or, with
``mode: external``, the controller process) scrapes the emulated engines, hands their figures to the
controller with its snapshot, and the plan decision says what share of the pool's capacity the foreign
requests held."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from fleet.evidence import PlanEvidence
from loadtest.chaos.controller_faults import ExternalControllerDeployment
from loadtest.chaos.fleet_faults import KEY as EXTERNAL_KEY
from tests.gateway.test_live_fleet import ADMIN, KEY, _admin, _traffic
from tests.support.procs import start_gateway, write_tenant

SPEED = 20.0
MODEL = "llama-3.1-8b"
NUM_FOREIGN_PER_REPLICA = 16


def _plan(url: str) -> dict[str, Any] | None:
    decisions: list[dict[str, Any]] = _admin(url, "/admin/decisions")["decisions"]  # type: ignore[assignment]
    return next((d for d in decisions if d["kind"] == "plan"), None)


async def _foreign(replica_urls: list[str], stop: asyncio.Event, per_replica: int) -> int:
    """``per_replica`` long requests on each replica, straight to its engine, renewed until ``stop``."""
    done = 0

    async def worker(client: openai.AsyncOpenAI) -> None:
        nonlocal done
        while not stop.is_set():
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
                                                 max_tokens=1500, extra_body={"ignore_eos": True})
            done += 1

    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-the-gateway", max_retries=0, timeout=120) for url in replica_urls]
    await asyncio.gather(*(worker(client) for client in clients for _ in range(per_replica)))
    for client in clients:
        await client.close()
    return done


async def _scenario(url: str, replica_urls: list[str], planned: Callable[[], bool] | None = None, key: str = KEY,
                    foreign_first_s: float = 3.0, per_replica: int = NUM_FOREIGN_PER_REPLICA) -> tuple[list[int], int]:
    """Foreign load from the start; the gateway's own short chats after ``foreign_first_s`` until the controller has
    planned (``planned``: by default, by the embedded controller's decisions at ``url``)."""
    stop = asyncio.Event()
    foreign = asyncio.create_task(_foreign(replica_urls, stop, per_replica))
    await asyncio.sleep(foreign_first_s)  # a window (120 fleet s = 6 s) mostly under foreign load by the time the plan comes
    statuses: list[int] = []
    deadline = time.monotonic() + 120.0  # a re-plan consults the performance model: seconds of CPU, more on a busy machine
    while time.monotonic() < deadline:
        statuses += await _traffic(url, duration_s=2.0, rate_rps=10.0, key=key)
        if await asyncio.to_thread(planned or (lambda: _plan(url) is not None)):
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


@pytest.mark.slow
def test_the_external_controller_reads_the_engines_and_its_plan_counts_the_foreign_load(tmp_path: Path) -> None:
    """``mode: external``: the gateways report only their own in-flight counts, so the figures come from the
    controller's own reads of each replica's /metrics; without them the plan has no foreign share."""
    with ExternalControllerDeployment(tmp_path) as deployment:
        deployment.wait_leading(deployment.start_controller("controller"))
        deployment.start_gateways()
        replica_urls = [r["url"] for p in deployment.plan()["pools"] for r in p["replicas"]]

        def planned() -> bool:
            return any(isinstance(d.evidence, PlanEvidence) for d in deployment.decisions())

        statuses, num_foreign_done = asyncio.run(_scenario(deployment.gateway_urls[0], replica_urls, planned, EXTERNAL_KEY,
                                                      foreign_first_s=8.0))
        plans = [d.evidence for d in deployment.decisions() if isinstance(d.evidence, PlanEvidence)]
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert plans and num_foreign_done > 0
    share = (plans[0].foreign_share or {}).get("mixed")
    # Its first plan follows the gateways' first requests at once, so the foreign load runs a window (120 fleet
    # s = 6 s) before them. The 16 requests per replica, renewed as they end, averaged 7.5 in flight in the
    # engines' figures, of a plan concurrency of about 340 for these short chats: 0.04 on a quiet machine,
    # 0.021-0.022 beside other work; 0.010 when the foreign load had covered only half the window. At least 0.01 is 3.4 foreign
    # requests per replica over the window, far above what the gateways' own short chats leave.
    assert share is not None and share >= 0.01, plans[0]
