"""The embedded controller over launched pools of two models: each model's controller plans only its own
replicas, a drift in one model's traffic moves that model's replicas, the other's stay, no request fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai

from fleet.controller_state import ControllerState, LoopState, SlotRecord
from fleet.telemetry import TrafficMix
from tests.conftest import free_port
from tests.gateway.test_live_fleet import _SERIAL, ADMIN, KEY, LONG_PROMPT, _admin, _serving
from tests.support.procs import start, start_gateway, write_tenant

LLAMA, QWEN = "llama-3.1-8b", "qwen3-8b"
# no declared pool serves qwen's long prompts on H100: its controller makes this one, named for its model, whose
# replicas must run qwen (the first launched pool on H100 is llama's: the engine of a made pool follows its model)
NEW_POOL = f"{QWEN}:long-context@H100-SXM"
SPEED = 10.0  # slower than test_live_fleet's 20: a replica restart on a busy machine has twice the wall time to answer


async def _load(url: str, duration_s: float, rate_rps: float, model_to_prompt: dict[str, str],
                model_to_rate: dict[str, float] | None = None) -> list[str]:
    """Requests of every model at ``rate_rps`` each (or its ``model_to_rate``) through the openai SDK; the
    outcome of each ("ok" or the error)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60.0)
    outcomes: list[str] = []

    async def one(model: str, prompt: str) -> None:
        try:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"[{next(_SERIAL)}] {prompt}"}], max_tokens=32,
                                                 extra_body={"ignore_eos": True})
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append(f"{model}: {exc}")

    rates = {model: (model_to_rate or {}).get(model, rate_rps) for model in model_to_prompt}
    sent = dict.fromkeys(model_to_prompt, 0)
    tasks = []
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < duration_s:
        for model, prompt in model_to_prompt.items():
            if sent[model] <= elapsed * rates[model]:  # each model on its own schedule, the first request at once
                tasks.append(asyncio.create_task(one(model, prompt)))
                sent[model] += 1
        await asyncio.sleep(1 / max(rates.values()))
    await asyncio.gather(*tasks)
    await client.close()
    return outcomes


def _pool_urls(url: str) -> dict[str, list[str]]:
    return {p["name"]: sorted(r["url"] for r in p["replicas"]) for p in _admin(url, "/admin/state")["pools"]}  # type: ignore[index,union-attr]


def _pool_argvs(url: str, pool: str) -> list[list[str]]:
    """The command lines of ``pool``'s launched replicas, as /admin/state shows them."""
    pools = {p["name"]: p for p in _admin(url, "/admin/state")["pools"]}  # type: ignore[index,union-attr]
    return [r["process"]["argv"] for r in pools[pool]["replicas"]]  # type: ignore[index]


def _two_models(tmp_path: Path, **controller: object) -> Path:
    """llama's chat pool of one emulated replica and qwen's of two, on one GPU kind (its slots are split
    between the models by the pool each serves in at start), the controller on (and ``controller``)."""
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "live", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    chat = {"gpu": "H100-SXM", "shapes": ["short-chat"]}
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [{**chat, "name": "llama-chat", "model": LLAMA, "replicas": {"emulated": 1}},
                      {**chat, "name": "qwen-chat", "model": QWEN, "replicas": {"emulated": 2}}],
            "emulator_speed": SPEED,
            "controller": {"enabled": True, "tick_s": 5.0, "decision_log": "decisions.jsonl", **controller},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def test_a_drift_in_one_models_traffic_moves_only_that_models_replicas(tmp_path: Path) -> None:
    path = _two_models(tmp_path)
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    try:
        before = _pool_urls(gateway.url)
        # qwen's traffic is long prompts (its one declared pool serves short chat); llama's stays short chat
        mix = {QWEN: LONG_PROMPT, LLAMA: "Say hello to the team, briefly."}
        outcomes = asyncio.run(_load(gateway.url, duration_s=14.0, rate_rps=10.0, model_to_prompt=mix))
        deadline = time.monotonic() + 60.0
        while not _serving(gateway.url, NEW_POOL) and time.monotonic() < deadline:
            outcomes += asyncio.run(_load(gateway.url, duration_s=4.0, rate_rps=10.0, model_to_prompt=mix))  # a busy machine plans late
        decisions = _admin(gateway.url, "/admin/decisions")["decisions"]
        after = _pool_urls(gateway.url)
        made = _pool_argvs(gateway.url, NEW_POOL)
        # a move between two models' pools is refused with OpenAI's error envelope
        refused = _move(gateway.url, "llama-chat-0", "qwen-chat")
    finally:
        gateway.stop()
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]
    by_model = {m: [d for d in decisions if d.get("model") == m] for m in (LLAMA, QWEN)}  # type: ignore[union-attr]
    assert len(by_model[LLAMA]) + len(by_model[QWEN]) == len(decisions), decisions  # every decision names its model
    qwen_plans = [d["evidence"] for d in by_model[QWEN] if d["kind"] == "plan"]
    assert any(p["outcome"] == "apply" for p in qwen_plans), by_model[QWEN]  # type: ignore[index]
    assert all(p["budget"] == {"H100-SXM": 2} for p in qwen_plans), qwen_plans  # type: ignore[index]
    moved = [m for d in by_model[QWEN] for m in d["evidence"].get("moves", [])]  # type: ignore[index,union-attr]
    assert moved and all(m[0].startswith("qwen-chat-") for m in moved), moved
    llama_plans = [d["evidence"] for d in by_model[LLAMA] if d["kind"] == "plan"]
    assert all(p["outcome"] == "keep" and p["budget"] == {"H100-SXM": 1} for p in llama_plans), llama_plans  # type: ignore[index]
    assert not [d for d in by_model[LLAMA] if "moves" in d["evidence"]], by_model[LLAMA]  # type: ignore[operator]
    assert after["llama-chat"] == before["llama-chat"]  # the other model's replica stayed where it was
    assert after[NEW_POOL] and len(after["qwen-chat"]) == 1
    assert made and all(argv[argv.index("--model") + 1] == QWEN for argv in made), made  # the made pool runs qwen, not llama
    assert refused[0] == 409 and "qwen3-8b" in refused[1]["error"]["message"], refused  # type: ignore[index]
    logged = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["model"]) for e in logged] == [(d["kind"], d["model"]) for d in decisions]  # type: ignore[index]


def _move(url: str, replica: str, pool: str) -> tuple[int, dict[str, object]]:
    body = json.dumps({"replica": replica, "to_pool": pool}).encode()
    request = urllib.request.Request(url + "/admin/move", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def _plan(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/plan", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_the_external_controller_plans_each_model_on_its_own_slots_and_a_restarted_one_resumes_them(tmp_path: Path) -> None:
    """``polymorph controller`` over two models' launched pools, beside a gateway: each gateway report carries
    its requests' models, qwen's drift moves only qwen's slots into a pool of its own that runs qwen, llama's slot
    stays, every decision names its model; a controller SIGKILLed and started again adopts the same plan."""
    port = free_port()
    path = _two_models(tmp_path, mode="external", url=f"http://127.0.0.1:{port}")
    argv = ["controller", "--config", str(path), "--replica-logs", str(tmp_path / "replicas"), "--stop-replicas-on-exit"]
    state_file = tmp_path / "decisions.state.json"
    controller = start(argv, port, tmp_path / "controller.log", "/healthz", timeout_s=60.0)
    gateway = None
    try:
        first = json.loads(state_file.read_text())
        model_to_slots = {m: sorted(s["slot"] for s in first["slots"] if s["model"] == m) for m in (LLAMA, QWEN)}
        gateway = start_gateway(tmp_path, ["--config", str(path)])
        mix = {QWEN: LONG_PROMPT, LLAMA: "Say hello to the team, briefly."}
        outcomes = asyncio.run(_load(gateway.url, duration_s=14.0, rate_rps=10.0, model_to_prompt=mix))
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not any(p["name"] == NEW_POOL and p["replicas"] for p in _plan(controller.url)["pools"]):
            outcomes += asyncio.run(_load(gateway.url, duration_s=4.0, rate_rps=10.0, model_to_prompt=mix))  # a busy machine plans late
        plan = _plan(controller.url)
        state = json.loads(state_file.read_text())
        made = [(s, _cmdline(s["pid"])) for s in state["slots"] if s["pool"] == NEW_POOL]
        controller.kill()  # its replicas outlive it (detached), for the next controller to adopt
        controller = start(argv, port, tmp_path / "controller-2.log", "/healthz", timeout_s=60.0)
        again = _plan(controller.url)
        outcomes += asyncio.run(_load(gateway.url, duration_s=2.0, rate_rps=10.0, model_to_prompt=mix))
    finally:
        if gateway is not None:
            gateway.stop()
        controller.stop()
        for slot in json.loads(state_file.read_text())["slots"] if state_file.exists() else ():  # a controller that failed leaves them
            if slot["pid"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot["pid"], signal.SIGKILL)
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]
    decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    by_model = {m: [d for d in decisions if d.get("model") == m] for m in (LLAMA, QWEN)}
    assert len(by_model[LLAMA]) + len(by_model[QWEN]) == len(decisions), decisions  # every decision names its model
    qwen_plans = [d["evidence"] for d in by_model[QWEN] if d["kind"] == "plan"]
    assert any(p["outcome"] == "apply" for p in qwen_plans) and all(p["budget"] == {"H100-SXM": 2} for p in qwen_plans), qwen_plans
    moved = [m[0] for d in by_model[QWEN] for m in d["evidence"].get("moves", [])]
    assert moved and set(moved) <= set(model_to_slots[QWEN]), (moved, model_to_slots)
    assert all(p["outcome"] == "keep" and p["budget"] == {"H100-SXM": 1} for p in (d["evidence"] for d in by_model[LLAMA] if d["kind"] == "plan"))
    assert not [d for d in by_model[LLAMA] if "moves" in d["evidence"]], by_model[LLAMA]
    pools = {p["name"]: p for p in plan["pools"]}
    assert pools[NEW_POOL]["model"] == QWEN and pools["llama-chat"]["model"] == LLAMA, pools
    assert [r["name"] for r in pools["llama-chat"]["replicas"]] == model_to_slots[LLAMA]  # llama's replica stayed where it was
    # the made pool's replicas run qwen (the state file records each slot's model and process)
    assert made and all(s["model"] == QWEN and argv[argv.index("--model") + 1] == QWEN for s, argv in made), made
    assert sorted(state["model_to_loop"]) == [LLAMA, QWEN]
    assert [again[k] for k in ("epoch", "version", "pools")] == [plan[k] for k in ("epoch", "version", "pools")]
    assert "resuming from" in (tmp_path / "controller-2.log").read_text()


def test_the_external_controller_refuses_a_state_whose_replicas_serve_a_model_the_config_no_longer_launches(tmp_path: Path) -> None:
    """Its replicas would be planned by no controller, or restarted with another model's engine: the leader says
    which file and which replica, and starts nothing."""
    path = _two_models(tmp_path, mode="external", url=f"http://127.0.0.1:{free_port()}")
    mix = TrafficMix(0.0, 120.0, (), ())
    loop = LoopState(mix, -math.inf, -math.inf, 0, 0, 0)
    slots = (SlotRecord("H100-SXM/0", "mistral-chat", "H100-SXM", "{}", "active", "http://127.0.0.1:9", 999_999_999, model="mistral-7b"),)
    state_file = tmp_path / "decisions.state.json"
    state_file.write_text(json.dumps(ControllerState("e", 3, slots, (("mistral-7b", loop),)).to_json()))
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "controller", "--config", str(path), "--replica-logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0, done.stderr
    assert "H100-SXM/0 serving 'mistral-7b', which the config no longer launches" in done.stderr and str(state_file) in done.stderr, done.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())  # no replica was started
