"""The controller on a real llama.cpp fleet: `polymorph loadtest` plays chat, then long prompts; the
controller detects the drift and moves the chat pool's real replica into the long-context pool, drained,
restarted with that pool's arguments on its CPU slot and verified, with the decision log explaining it.

The controller's timings are the config's (`fleet.controller.window_s`, `drift`, `verify_after_s`), short
here so that the drift plays in about two minutes of real time; the defaults take about seven
(README, Real engines)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleet.engines.launch import EngineLaunch, launch_argv
from kernels.config import EngineConfig
from tests.conftest import REPO
from tests.gateway.test_admin_move import ADMIN, _admin, _replica
from tests.support.procs import start_gateway, write_tenant

KEY = "sk-polymorph-demo"


def _chat(weight: float) -> dict[str, Any]:
    return {"name": "chat", "weight": weight, "domain": "chat", "tier": "interactive",
            "input": {"lognormal": {"median": 100, "sigma": 0.3}, "min": 20, "max": 300},
            "output": {"lognormal": {"median": 12, "sigma": 0.3}, "min": 4, "max": 24}}


# long-context from 1,024 prompt tokens (the gateway's count); the tiny model's context is 2,048 of its own tokens
LONG = {"name": "long", "weight": 1.0, "domain": "summarization", "tier": "standard",
        "input": {"lognormal": {"median": 1080, "sigma": 0.03}, "min": 1040, "max": 1150},
        "output": {"lognormal": {"median": 96, "sigma": 0.1}, "min": 80, "max": 112}}


def cpu_fleet_config(tmp_path: Path, pools: list[dict[str, Any]], **fleet: Any) -> Path:
    """A gateway config of real llama.cpp ``pools`` on two CPU slots (and ``fleet`` fields), the tenant
    ``demo`` (``KEY``), shapes split at 1,024 prompt tokens; written to ``tmp_path``."""
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "demo", KEY, max_concurrency=100, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "shapes": [{"name": "long-context", "min_prompt_tokens": 1024}, {"name": "short-chat", "max_prompt_tokens": 1023}],
        "default_shape": "short-chat",
        "fleet": {"devices": {"cpu": {"count": 2}}, "pools": pools, **fleet},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def _config(tmp_path: Path) -> Path:
    engine = {"kind": "llamacpp", "threads": 1}
    return cpu_fleet_config(
        tmp_path, [{"name": "chat-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
                    # -c 8192: long prompts overflowing here while long-cpu is short fit beside the chats in its one
                    # KV cache (with the model's 2,048, llama-server fails some with "Context size has been exceeded",
                    # which the gateway retries on long-cpu: gateway/engine_errors.py)
                    "engine": {**engine, "max_running_requests": 4, "max_total_tokens": 8192}, "replicas": {"launch": 1}},
                   {"name": "long-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["long-context"],
                    "engine": {**engine, "max_running_requests": 1}, "replicas": {"launch": 1}}],
        # the chat mix is planned at ~5 s and refined at ~25 s (its drift's start + window_s), before the long prompts;
        # a step is judged on 12 s of long prompts (~12 finished on a busy machine), within their counting noise
        # (fleet.controller.counting_noise_rps: a full `make test` once measured 1.0 req/s against a floor of 1.02)
        controller={"enabled": True, "tick_s": 2.0, "decision_log": "decisions.jsonl", "window_s": 20, "verify_after_s": 12,
                    "backoff_s": 30, "drift": {"warmup_s": 5, "dwell_s": 4, "strong_dwell_s": 2, "min_interval_s": 15}})


def _move_verified(decisions: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The step that moved chat-cpu-0 into long-cpu, and the verification that followed it (None: not yet)."""
    for i, d in enumerate(decisions):
        if d["kind"] == "step" and d["evidence"]["moves"] == [["chat-cpu-0", "chat-cpu", "long-cpu"]]:
            return next(((d, v) for v in decisions[i + 1:] if v["kind"] == "verify"), None)
    return None


def _story(decisions: list[dict[str, Any]]) -> str:
    """The decision log as one line a decision, what a failed run's message needs to tell why: a drift's
    sample (per shape: rate, mean prompt and output tokens), a plan's diff and the goodputs it weighed."""
    lines = []
    for d in decisions:
        e = d["evidence"]
        if d["kind"] == "drift":
            what = {s: (v["rate_rps"], v["prompt_tokens"], v["output_tokens"]) for s, v in e["mix_after"]["shapes"].items()}
        elif d["kind"] == "plan":
            what = {k: e.get(k) for k in ("trigger", "outcome", "diff", "declined", "predicted_goodput_before_rps",
                                          "predicted_goodput_after_rps", "configs")}
        else:
            what = {k: e.get(k) for k in ("moves", "ok", "reason") if k in e}
        lines.append(f"{d['at_unix_s'] - decisions[0]['at_unix_s']:6.1f} s {d['kind']} {what}")
    return "\n".join(lines)


@pytest.mark.slow
def test_the_controller_detects_a_played_drift_and_moves_a_real_llamacpp_replica(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    scenario = tmp_path / "drift.yaml"
    scenario.write_text(json.dumps({
        "name": "cpu-drift-short", "duration_s": 105, "seed": 5,
        # 35 s of chat, then long prompts at more than one long-context replica serves
        "streams": [{"name": "chat", "arrival": {"process": "poisson", "rate_rps": 2.0}, "tenants": {"demo": 1.0}, "end_s": 35,
                     "classes": [_chat(1.0)]},
                    {"name": "long", "arrival": {"process": "poisson", "rate_rps": 3.5}, "tenants": {"demo": 1.0}, "start_s": 35,
                     "classes": [LONG]}],
    }))
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path)), "--replica-logs", str(tmp_path / "replicas")], timeout_s=180)
    state: dict[str, Any] | None = None  # /admin/state once the move is verified (a later refine may recompile the replica again)
    try:
        before = _replica(_admin(gateway.url, "/admin/state")[1], "chat-cpu-0")[1]
        with subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "loadtest", "--target", gateway.url, "--api-key", KEY, "--model", "tiny-llama",
                 "--scenario", str(scenario), "--out", str(tmp_path / "run"), "--no-progress"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as played:
            while played.poll() is None:
                time.sleep(1.0)
                if state is None and _move_verified(_admin(gateway.url, "/admin/decisions")[1]["decisions"]) is not None:
                    state = _admin(gateway.url, "/admin/state")[1]
            stderr = played.stderr.read() if played.stderr is not None else ""
        decisions = _admin(gateway.url, "/admin/decisions")[1]["decisions"]
    finally:
        gateway.stop()
    assert played.returncode == 0, stderr[-3000:]
    story = _story(decisions)
    drifts = [i for i, d in enumerate(decisions) if d["kind"] == "drift" and "long-context" in d["evidence"]["mix_after"]["shapes"]]
    assert drifts, story
    # the drift's own plan (from the few seconds since the change) or its refine (once the window holds only the
    # long prompts) moves the chat replica: which one depends on how many long prompts the first sample held
    after = decisions[drifts[0]:]
    at = next((i for i, d in enumerate(after) if d["kind"] == "plan" and d["evidence"].get("diff")), None)
    assert at is not None, story
    assert after[at]["evidence"]["diff"] == {"chat-cpu": [1, 0], "long-cpu": [1, 2]}, story
    found = _move_verified(after)
    assert found is not None, story
    step, verify = found
    assert verify["evidence"]["ok"] is True, verify
    assert not any(d["kind"] == "rollback" for d in after[after.index(step):after.index(verify)]), story
    # the moved replica ran the long pool's configuration as that plan chose it, rendered as a long-cpu replica's
    # arguments (the gateway adds --host and --port), on its own CPU slot
    assert state is not None
    pool, moved = _replica(state, "chat-cpu-0")
    planned = EngineConfig.from_dict(json.loads(after[at]["evidence"]["configs"]["long-cpu"]))
    expected = list(launch_argv(EngineLaunch("llamacpp", threads=1, served_model_name="tiny-llama"), planned, "cpu"))
    assert pool == "long-cpu" and moved["argv"][:-4] == expected, (moved["argv"], expected)
    assert before["argv"][:-4] != expected and before["devices"] == moved["devices"], (before, moved)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["completed"] > 100, results
