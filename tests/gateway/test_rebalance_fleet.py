"""One GPU budget per kind shared across models, live (fleet.rebalance): qwen's long-prompt traffic outgrows its one
replica while llama's chat needs one of its two, so one of llama's slots changes owner and restarts as a qwen
replica in qwen's pool; no request of either model fails."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from tests.gateway.test_live_fleet import ADMIN, KEY, LONG_PROMPT, _admin
from tests.gateway.test_multi_model_fleet import _load
from tests.support.procs import start_gateway, write_tenant

LLAMA, QWEN = "llama-3.1-8b", "qwen3-8b"
SPEED = 10.0
# ~12,000 prompt tokens: one emulated H100 replica serves ~0.5 fleet rps of them within the interactive tier's SLO
# (5 wall rps at SPEED); qwen sends 12, which its plan needs more replicas for
QWEN_PROMPT, QWEN_RPS = LONG_PROMPT * 2, 8.0
LLAMA_PROMPT, LLAMA_RPS = "Say hello to the team, briefly.", 2.0
MIX = {QWEN: QWEN_PROMPT, LLAMA: LLAMA_PROMPT}


def _qwen_pool(url: str) -> list[dict[str, object]]:
    pools = {p["name"]: p for p in _admin(url, "/admin/state")["pools"]}  # type: ignore[index,union-attr]
    return pools["qwen-long"]["replicas"]  # type: ignore[no-any-return]


def test_an_idle_models_slot_moves_to_the_model_whose_traffic_outgrew_its_slots(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "live", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        # no pool queues: a request waits in the engine, never shed while qwen's one replica is overloaded
        "upstream": {"queue_max_len": 0},
        "fleet": {
            "pools": [{"name": "llama-chat", "model": LLAMA, "gpu": "H100-SXM", "shapes": ["short-chat"], "replicas": {"emulated": 2}},
                      {"name": "qwen-long", "model": QWEN, "gpu": "H100-SXM", "shapes": ["long-context"], "replicas": {"emulated": 1},
                       # the configuration the controller picks for these prompts: its one replica is not restarted to get it
                       "engine": {"chunked_prefill_size": 2048}}],
            "emulator_speed": SPEED,
            "controller": {"enabled": True, "tick_s": 5.0, "decision_log": "decisions.jsonl"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    try:
        outcomes = asyncio.run(_load(gateway.url, 12.0, QWEN_RPS, MIX, {LLAMA: LLAMA_RPS}))
        # a busy machine plans late: the re-plan's capacity runs on niced workers (a fresh run beside the
        # installs made no decision at all within 47 s)
        deadline = time.monotonic() + 120.0
        while len(_qwen_pool(gateway.url)) < 2 and time.monotonic() < deadline:
            outcomes += asyncio.run(_load(gateway.url, 3.0, QWEN_RPS, MIX, {LLAMA: LLAMA_RPS}))
        qwen = _qwen_pool(gateway.url)
        decisions = _admin(gateway.url, "/admin/decisions")["decisions"]
    finally:
        gateway.stop()
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]
    rebalances = [d for d in decisions if d["kind"] == "rebalance"]  # type: ignore[index]
    assert len(rebalances) == 1, decisions
    evidence = rebalances[0]["evidence"]  # type: ignore[index]
    assert (evidence["from_model"], evidence["to_model"], evidence["gpu"], evidence["from_pool"]) == (LLAMA, QWEN, "H100-SXM", "llama-chat")  # type: ignore[index]
    assert evidence["to_goodput_after_rps"] > evidence["to_goodput_before_rps"]  # type: ignore[index,operator]
    assert evidence["from_goodput_after_rps"] == evidence["from_goodput_before_rps"]  # type: ignore[index]
    slot = evidence["slot"]  # type: ignore[index]
    moved = [m for d in decisions if d.get("model") == QWEN for m in d["evidence"].get("moves", [])]  # type: ignore[union-attr,index]
    assert [slot, "llama-chat", "qwen-long"] in moved, decisions
    # the slot llama's pool held now runs qwen's engine in qwen's pool
    by_name = {r["name"]: r for r in qwen}
    assert slot in by_name, qwen
    argv = by_name[slot]["process"]["argv"]  # type: ignore[index]
    assert argv[argv.index("--model") + 1] == QWEN, argv  # type: ignore[union-attr]
