"""``urls`` pools with fleet.controller enabled: the gateway prices them with the capacity model from the
traffic it measures (the prefix cache's share included) and routes on those models; it moves nothing."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import aiohttp

from tests.support.procs import running, start_emulator, start_gateway, write_tenant

KEY, ADMIN = "sk-test-modeller", "admin-token-modeller"
SPEED = 20.0
WINDOW_S, WARMUP_S = 1200.0, 600.0  # fleet seconds of telemetry kept, and needed before the first model (30 s here)
MIN_SHARED_RATE_RPS = 40.0  # ~2,100-token chats on an H100 with nothing cached: ~15 req/s
SYSTEM = "You are the support assistant of a large retailer. Answer briefly and politely. " * 130  # ~2,100 shared tokens


def _pools(url: str) -> dict[str, dict[str, object]]:
    request = urllib.request.Request(url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return {p["name"]: p for p in json.loads(resp.read())["pools"]}


async def _chats(url: str, num: int) -> list[int]:
    body = {"model": "llama-3.1-8b", "max_tokens": 32, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]}
    async with aiohttp.ClientSession() as session:

        async def one(k: int) -> int:
            await asyncio.sleep(k * 0.02)
            async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                await resp.read()
                return resp.status

        return list(await asyncio.gather(*(one(k) for k in range(num))))


def test_url_pools_get_capacity_models_from_measured_traffic(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "modeller", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    chat, long = start_emulator(tmp_path, "chat", "H100-SXM", SPEED), start_emulator(tmp_path, "long", "H200", SPEED)
    with running(chat, long):
        config = {
            "server": {"admin_token": ADMIN, "access_log": False},
            "tenants_dir": "tenants",
            "fleet": {
                "pools": [
                    {"name": "chat-h100", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat", "batch"],
                     "engine": {"kind": "emulated", "chunked_prefill_size": 2048}, "replicas": {"urls": [chat.url]}},
                    {"name": "long-h200", "model": "llama-3.1-8b", "gpu": "H200", "shapes": ["long-context", "reasoning"],
                     "engine": {"kind": "emulated"}, "replicas": {"urls": [long.url]}},
                ],
                "emulator_speed": SPEED,
                # the first model waits for the drift detector's warm-up, as the controller does before it plans
                "controller": {"enabled": True, "tick_s": 5.0, "window_s": WINDOW_S, "drift": {"warmup_s": WARMUP_S}},
            },
        }
        (tmp_path / "config.yaml").write_text(json.dumps(config))
        gateway = start_gateway(tmp_path, ["--config", str(tmp_path / "config.yaml")])
        with running(gateway):
            assert _pools(gateway.url)["chat-h100"]["rate_per_replica_rps"] == 0  # nothing measured yet: no model
            started = time.monotonic()
            statuses: list[int] = []
            while time.monotonic() - started < 12.0:  # 240 fleet s: 48 ticks, time enough to price a window (a few s)
                statuses += asyncio.run(_chats(gateway.url, 40))
            young = _pools(gateway.url)["chat-h100"]["rate_per_replica_rps"]  # they priced nothing: the window is too young
            young_s = (time.monotonic() - started) * SPEED
            rates: list[float] = []
            deadline = time.monotonic() + 90.0
            while (not rates or rates[-1] <= MIN_SHARED_RATE_RPS) and time.monotonic() < deadline:
                statuses += asyncio.run(_chats(gateway.url, 40))  # each tick prices the window (5 fleet s: 0.25 s here)
                rates.append(float(_pools(gateway.url)["chat-h100"]["rate_per_replica_rps"]))  # type: ignore[arg-type]
            pools = _pools(gateway.url)
    assert statuses and set(statuses) == {200}
    assert young_s < WARMUP_S and young == 0, (young_s, young)  # read before the warm-up could end
    assert "models the urls pools chat-h100, long-h200" in gateway.log()
    modelled = pools["chat-h100"]
    # the chats share a ~2,100-token system prompt, of which the engine caches four 512-token blocks: priced
    # as such, one H100 serves several times the ~14 req/s of ~2,100 new tokens each (fleet/capacity.py)
    assert modelled["rate_per_replica_rps"] > MIN_SHARED_RATE_RPS and modelled["max_running_per_replica"] >= 1 and modelled["cost_per_hour"] > 0
    assert pools["long-h200"]["rate_per_replica_rps"] == 0  # no long prompt was sent: nothing to price it on
