"""`polymorph compile --fleet-config FILE --pool NAME`: the pool's model, GPU kind, engine and weights stand for
the compile flags, and a probe runs on devices of fleet.devices that none of the config's launched replicas holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.procs import write_tenant

POLYMORPH = [sys.executable, "-m", "gateway.cli"]
SGLANG_STANDIN = Path(__file__).resolve().parents[1] / "support" / "sglang_standin.py"


def _config(tmp_path: Path, pools: list[dict[str, Any]], devices: dict[str, Any]) -> Path:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "ops", "sk-ops")
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({"tenants_dir": "tenants", "fleet": {"devices": devices, "pools": pools}}, indent=1))
    return path


def _sglang_pool(name: str, weights: Path, launch: int, shapes: list[str]) -> dict[str, Any]:
    return {"name": name, "model": "tiny-llama", "gpu": "H100-SXM", "shapes": shapes, "replicas": {"launch": launch},
            "engine": {"kind": "sglang", "command": f"{sys.executable} {SGLANG_STANDIN}", "model_path": str(weights)}}


def _compile(config: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLYMORPH, "compile", "--fleet-config", str(config), *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False, env=env)


def test_a_probe_of_a_pool_runs_its_engine_and_weights_on_a_device_the_fleet_does_not_hold(tmp_path: Path) -> None:
    """sglang cannot run here: the pool's interpreter is the stand-in that serves the emulator and records
    what it was given (tests/support/sglang_standin.py)."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"not really weights")
    record = tmp_path / "standin.jsonl"
    # devices 4 and 7 go to the two launched chat replicas, 2 to the long one; 5 is free
    config = _config(tmp_path, [_sglang_pool("chat-h100", weights, 2, ["short-chat"]), _sglang_pool("long-h100", weights, 1, ["long-context"])],
                     {"H100-SXM": {"ids": [4, 7, 2, 5]}})
    env = {**os.environ, "STANDIN_MODEL": "tiny-llama", "STANDIN_GPU": "H100-SXM", "STANDIN_RECORD": str(record)}
    done = _compile(config, "--pool", "chat-h100", "--evaluate", "probe", "--budget", "2", "--probe-requests", "3",
                    "--store", str(tmp_path / "trials.sqlite3"), "--json", env=env, timeout_s=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["engine"] == "sglang" and out["shape"] == "short-chat"
    assert out["fingerprint"]["hardware"] == "H100-SXM x 1 (devices 5)"
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 2 and all(s["cuda_visible_devices"] == "5" for s in starts)
    assert all(s["argv"][s["argv"].index("--model-path") + 1] == str(weights) for s in starts)


def test_a_pool_compile_says_what_it_cannot_do(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    held = _config(tmp_path, [_sglang_pool("chat-h100", weights, 2, ["short-chat", "batch"])], {"H100-SXM": {"ids": [0, 1]}})
    answers = {
        "all held": _compile(held, "--pool", "chat-h100", "--shape", "short-chat", "--evaluate", "probe"),
        "two shapes": _compile(held, "--pool", "chat-h100", "--evaluate", "probe"),
        "no pool": _compile(held, "--evaluate", "probe"),
        "unknown pool": _compile(held, "--pool", "nope"),
        "flag beside": _compile(held, "--pool", "chat-h100", "--model", "llama-3.1-8b", "--devices", "1"),
        "pool alone": subprocess.run([*POLYMORPH, "compile", "--pool", "chat-h100"], capture_output=True, text=True, timeout=60, check=False),
        # before, the pool's values silently replaced these, and a shape it does not serve was compiled for it
        "gpus beside": _compile(held, "--pool", "chat-h100", "--shape", "short-chat", "--gpus", "4"),
        "engine beside": _compile(held, "--pool", "chat-h100", "--shape", "short-chat", "--engine", "vllm"),
        "foreign shape": _compile(held, "--pool", "chat-h100", "--shape", "long-context"),
    }
    emulated = tmp_path / "emulated"
    emulated.mkdir()
    answers["emulated"] = _compile(_config(emulated, [{"name": "chat", "model": "tiny-llama", "gpu": "H100-SXM", "shapes": ["short-chat"],
                                                       "replicas": {"emulated": 1}}], {"H100-SXM": {"count": 2}}),
                                   "--pool", "chat", "--evaluate", "probe")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants_dir: tenants\nfleet:\n  pools:\n    - name: chat\n      model: tiny-llama\n      gpu: H100-SXM\n      replicas: {launch: -1}\n")
    answers["bad config"] = _compile(bad, "--pool", "chat")
    for name, done in answers.items():
        assert done.returncode != 0 and "Traceback" not in done.stderr, (name, done.stderr)
    said = {name: done.stderr for name, done in answers.items()}
    assert "hold 2 of fleet.devices' 2 H100-SXM devices (chat-h100 x2)" in said["all held"] and "POST /admin/canary" in said["all held"]
    assert "serves short-chat, batch; give --shape" in said["two shapes"]
    assert "needs --pool, one of chat-h100" in said["no pool"] and "no pool 'nope'" in said["unknown pool"]
    assert "takes --model, --devices from the pool" in said["flag beside"]
    assert "--pool names a pool of --fleet-config" in said["pool alone"]
    assert "replicas hold 1 device(s); leave --gpus out" in said["gpus beside"] and "runs sglang; leave --engine out" in said["engine beside"]
    assert "serves short-chat, batch, not 'long-context'" in said["foreign shape"]
    assert "runs emulated replicas" in said["emulated"]
    assert "invalid config" in said["bad config"] and "bad.yaml:7" in said["bad config"]


def test_a_trace_is_the_shape_of_a_pool_that_serves_one(tmp_path: Path) -> None:
    """Before: the pool's one shape was filled in beside --trace, and the compile said 'give exactly one of
    --shape NAME or --trace FILE' to a user who gave only --trace."""
    config = _config(tmp_path, [_sglang_pool("chat-h100", tmp_path / "weights", 1, ["short-chat"])], {"H100-SXM": {"ids": [0, 1]}})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 200 + i, "output_length": 50}) + "\n" for i in range(20)))
    done = _compile(config, "--pool", "chat-h100", "--trace", str(trace), "--format", "native", "--evaluator", "analytic",
                    "--budget", "2", "--no-store")
    assert done.returncode == 0, done.stderr
