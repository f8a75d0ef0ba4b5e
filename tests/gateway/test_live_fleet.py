"""The control loop live: the gateway's controller drains, moves and restarts emulated replicas under
load, logs every decision, and no request fails while it does."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import urllib.request
from pathlib import Path

import aiohttp

from fleet.health import CircuitBreaker
from fleet.rollout import SlotState
from gateway.live_fleet import EjectionWatch
from tests.support.procs import start_gateway, write_tenant

KEY, ADMIN = "sk-test-live", "admin-token-live"
SPEED = 20.0  # emulated GPUs, and the controller's clock, run 20x faster than real time
LONG_PROMPT = "Summarise the minutes of the meeting below. " + "The team reviewed the quarter's roadmap. " * 700  # long-context
_SERIAL = itertools.count()  # each request's prompt opens with its own number: engines cache none (cached prompts are cheap)
NEW_POOL = "long-context@H100-SXM"  # no declared pool serves long prompts on H100: the controller makes this one


def _admin(url: str, path: str) -> dict[str, object]:
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _serving(url: str, pool: str) -> bool:
    return any(p["name"] == pool and p["replicas"] for p in _admin(url, "/admin/state")["pools"])  # type: ignore[index,union-attr]


async def _traffic(url: str, duration_s: float, rate_rps: float, content: str = "Say hello to the team, briefly.", key: str = KEY) -> list[int]:
    statuses: list[int] = []
    async def one(session: aiohttp.ClientSession) -> None:
        body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": f"[{next(_SERIAL)}] {content}"}], "max_tokens": 64, "ignore_eos": True}
        async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            await resp.read()
            statuses.append(resp.status)

    async with aiohttp.ClientSession() as session:
        tasks = []
        started = time.monotonic()
        while time.monotonic() - started < duration_s:
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(1 / rate_rps)
        await asyncio.gather(*tasks)
    return statuses


def test_controller_repartitions_under_load_without_failing_a_request(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "live", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [{"name": "mixed", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"], "replicas": {"emulated": 2}}],
            "emulator_speed": SPEED,
            # the step's verification waits past the test (90 s real): judged on SLOs, which a busy machine misses at
            # 20x speed, it rolled the move back on one CI run; verification has its own tests (test_real_drift)
            "controller": {"enabled": True, "tick_s": 5.0, "decision_log": "decisions.jsonl", "verify_after_s": 1800},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    try:
        # long prompts, and the one declared pool serves short chat: the controller makes a pool for them and moves a replica there
        statuses = asyncio.run(_traffic(gateway.url, duration_s=14.0, rate_rps=25.0, content=LONG_PROMPT))
        deadline = time.monotonic() + 90.0
        while not _serving(gateway.url, NEW_POOL) and time.monotonic() < deadline:
            statuses += asyncio.run(_traffic(gateway.url, duration_s=5.0, rate_rps=25.0, content=LONG_PROMPT))  # a busy machine plans late
        decisions = _admin(gateway.url, "/admin/decisions")["decisions"]
        state = _admin(gateway.url, "/admin/state")
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
    finally:
        gateway.stop()
    assert statuses and set(statuses) == {200}, f"{len(statuses)} requests: {sorted(set(statuses))}"
    kinds = [d["kind"] for d in decisions]  # type: ignore[union-attr]
    assert kinds[:3] == ["drift", "plan", "step"], kinds
    moved = decisions[2]["evidence"]["moves"]  # type: ignore[index]
    # every prompt is its own: the engines' cached tokens, which reach telemetry, say none was cached (one block at most)
    assert decisions[0]["evidence"]["mix_after"]["shapes"]["long-context"]["prefix_share"] < 0.2  # type: ignore[index]
    assert moved and all(m[1:] == ["mixed", NEW_POOL] for m in moved)
    pools = {p["name"]: p for p in state["pools"]}  # type: ignore[union-attr]
    assert NEW_POOL in pools and pools[NEW_POOL]["replicas"] and pools["mixed"]["replicas"], kinds  # the declared pool keeps a replica
    planned = pools[NEW_POOL]  # the router scores it with the plan's capacity model
    assert planned["rate_per_replica_rps"] > 0 and planned["cost_per_hour"] > 0 and planned["max_running_per_replica"] >= 1
    logged = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [entry["kind"] for entry in logged] == kinds
    # the decisions as Prometheus counters, by kind (each counted at least as often as the log held it when read)
    counted = {kind: float(value) for kind, value in re.findall(r'^polymorph_fleet_decisions_total\{kind="(\w+)"\} (\S+)$', metrics, re.M)}
    assert all(counted.get(kind, 0.0) >= kinds.count(kind) for kind in set(kinds)) and counted, metrics
    assert "polymorph_decision_log_unwritten 0.0" in metrics and "polymorph_decision_log_dropped_total 0.0" in metrics


def test_a_replica_ejected_for_three_cooldowns_leaves_the_budget_and_comes_back_when_healthy() -> None:
    slots = [SlotState("H100-SXM/0", "mixed", "H100-SXM", "{}"), SlotState("H100-SXM/1", "mixed", "H100-SXM", "{}"),
             SlotState("H100-SXM/2", "mixed", "H100-SXM", "{}")]
    flaky, hung = CircuitBreaker(2, 1.0), CircuitBreaker(2, 1.0)
    breakers = {"H100-SXM/0": flaky, "H100-SXM/1": hung}  # slot 2 is not routed (starting): left as it is
    watch = EjectionWatch()

    def alive(now: float) -> list[bool]:
        return [s.alive for s in watch.apply(slots, breakers, now)]

    for breaker in (flaky, hung):
        breaker.on_failure(0.0), breaker.on_failure(0.0)  # ejected at t=0
    assert alive(0.0) == [True, True, True]
    hung.on_dispatch(), hung.on_failure(1.5)  # its probe after the cool-down fails: ejected again, down since t=0
    flaky.on_dispatch(), flaky.on_success()  # probe succeeded ...
    flaky.on_failure(2.0), flaky.on_failure(2.0)  # ... then a new run of failures: down since t=2
    assert alive(2.0) == [True, True, True]
    assert alive(3.5) == [True, False, True]
    assert alive(5.5) == [False, False, True]
    hung.on_dispatch(), hung.on_success()
    assert alive(6.0) == [False, True, True]
