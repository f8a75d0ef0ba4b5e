"""Canary trials on live traffic (``POST /admin/canary``): one replica of a pool restarts on a new engine
configuration, serves beside its unchanged sibling, and is adopted (the sibling follows) or rolled back, by
the noise the two measured on one configuration before; both sides' figures are in the decision log.

The emulated case checks the API's answers; the llama.cpp case trials real ``llama-server`` replicas of the
tiny model under concurrent load whose requests share a long system prompt: prompt caching on (``--cache-reuse``)
against off (``--no-cache-prompt``) is adopted, then off against on is rolled back, with 0 requests failed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.decisions import read_decision
from fleet.evidence import CanaryEvidence
from tests.gateway.test_admin_move import ADMIN, KEY, _admin, _Load, _move_and_watch, _replica, _until
from tests.gateway.test_config import _error_for, _line_of
from tests.support.procs import Proc, start_gateway, write_tenant


def _config(tmp_path: Path, pools: list[dict[str, Any]], canary: dict[str, Any], router: dict[str, Any] | None = None, **fleet: Any) -> Path:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "ops", KEY, max_concurrency=100, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "router": router or {},
        "fleet": {"pools": pools, **fleet, "controller": {"enabled": False, "decision_log": "decisions.jsonl", "canary": canary}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def test_a_canary_window_of_zero_is_a_config_error_naming_its_line(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "    tick_s: 5.0\n", "    tick_s: 5.0\n    canary:\n      window_s: 0\n")
    assert err.field == "fleet.controller.canary.window_s" and "between 1 and" in err.reason
    assert err.line == _line_of(Path(err.file), "window_s: 0")


def test_the_canary_api_answers_bad_requests_with_openai_errors(tmp_path: Path) -> None:
    pools = [
        {"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 64}, "replicas": {"emulated": 2}},
        {"name": "long", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["long-context"],
         "engine": {"max_running_requests": 8}, "replicas": {"emulated": 1}},
    ]
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, pools, {"window_s": 60}, emulator_speed=20.0))], timeout_s=120)
    try:
        answers = {
            "no config": _admin(gateway.url, "/admin/canary", {"pool": "chat"}),
            # before, an unknown field was ignored and the canary began
            "dry run": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"max_running_requests": 8}, "dry_run": True}),
            "unknown knob": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"kind": "vllm"}}),
            "more devices": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"tp": 2}}),
            "unknown pool": _admin(gateway.url, "/admin/canary", {"pool": "nope", "config": {"max_running_requests": 8}}),
            "pool of one": _admin(gateway.url, "/admin/canary", {"pool": "long", "config": {"max_running_requests": 4}}),
            "same config": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"max_running_requests": 64}}),
            "begun": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"max_running_requests": 8}}),
            "second": _admin(gateway.url, "/admin/canary", {"pool": "chat", "config": {"max_running_requests": 16}}),
            "move meanwhile": _admin(gateway.url, "/admin/move", {"replica": "long-0", "to_pool": "chat"}),
        }
    finally:
        gateway.stop()
    status = {name: code for name, (code, _) in answers.items()}
    assert status == {"no config": 400, "dry run": 400, "unknown knob": 400, "more devices": 400, "unknown pool": 404, "pool of one": 409,
                      "same config": 409, "begun": 202, "second": 409, "move meanwhile": 409}, answers
    assert answers["no config"][1]["error"]["param"] == "config" and answers["unknown knob"][1]["error"]["param"] == "config"
    assert "unknown engine config key 'kind'" in answers["unknown knob"][1]["error"]["message"]
    assert answers["dry run"][1]["error"]["param"] == "dry_run" and answers["dry run"][1]["error"]["code"] == "unknown_field"
    assert answers["begun"][1]["canary"] == {"pool": "chat", "config": {"max_running_requests": 8}}
    assert "one trial at a time" in answers["second"][1]["error"]["message"]


def _trial(gateway: Proc, load: _Load, config: dict[str, Any], timeout_s: float, pool: str = "chat-cpu") -> list[dict[str, Any]]:
    """Begin a canary of ``pool`` under ``load`` and wait until it ended (verify after an adoption, or the
    canary restored); the decision log's entries since."""
    earlier = len(_admin(gateway.url, "/admin/decisions")[1]["decisions"])
    status, answer = _admin(gateway.url, "/admin/canary", {"pool": pool, "config": config})
    assert status == 202, answer

    def ended() -> bool:
        entries = _admin(gateway.url, "/admin/decisions")[1]["decisions"][earlier:]
        kinds = [(d["kind"], d["evidence"].get("outcome")) for d in entries]
        return ("verify", None) in kinds or ("rollback", "restored") in kinds or ("canary", "abandoned") in kinds

    _until(ended, timeout_s, "the canary ends")
    seen = load.ok
    _until(lambda: load.ok >= seen + 4, 60, "load flowing after the canary")
    entries: list[dict[str, Any]] = _admin(gateway.url, "/admin/decisions")[1]["decisions"][earlier:]
    return entries


def test_an_adopted_configuration_is_what_the_pool_runs_and_what_a_replica_moved_into_it_starts_with_and_survives_a_restart(
        tmp_path: Path) -> None:
    # fp8 weights: a decode step reads half the bytes, so the canary answers ~1.8x faster per token (emulated at 20x)
    pools = [
        {"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 64}, "replicas": {"emulated": 2}},
        {"name": "long", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["long-context"],
         "engine": {"max_running_requests": 8, "chunked_prefill_size": 8192}, "replicas": {"emulated": 1}},
    ]
    # 180 fleet s a side (9 s here), ~550 requests: on a busy CI machine 60 s (~185) measured fp8 19.8% faster
    # against an a/a noise of 22.0% (every request's own time per token varies: cv 0.6-1.1), and rolled it back
    config = _config(tmp_path, pools, {"window_s": 180, "min_requests": 10, "min_margin": 0.1}, emulator_speed=20.0)
    gateway = start_gateway(tmp_path, ["--config", str(config)], timeout_s=120)
    try:
        with _Load(gateway.url, "llama-3.1-8b", 64, num_threads=6) as load:
            _until(lambda: load.ok >= 6, 60, "load flowing")
            trial = _trial(gateway, load, {"quantization": "fp8"}, 120, pool="chat")
        state = _admin(gateway.url, "/admin/state")[1]
        load, moved = _move_and_watch(gateway, "long-0", "chat", "llama-3.1-8b", 16, 60)
        after = _admin(gateway.url, "/admin/state")[1]
    finally:
        gateway.stop()
    # the same config and decision log again: the pool starts on what it adopted (fleet.adoptions), the declared
    # configuration unchanged; the moved replica starts in its declared pool, as the config launches it
    again = start_gateway(tmp_path, ["--config", str(config)], name="restarted", timeout_s=120)
    try:
        restarted = _admin(again.url, "/admin/state")[1]
    finally:
        again.stop()
    assert [(d["kind"], d["evidence"].get("outcome")) for d in trial] == [("step", None), ("canary", "adopt"), ("step", None), ("verify", None)], trial
    chat = next(p for p in state["pools"] if p["name"] == "chat")
    adopted = {"max_running_requests": 64, "quantization": "fp8"}
    assert chat["engine"] == {"max_running_requests": 64} and chat["running_engine"] == adopted
    # the move into the pool starts the configuration its replicas run, not the declared one
    assert [d["kind"] for d in moved[-2:]] == ["step", "verify"] and load.failed == []
    assert _replica(after, "long-0")[0] == "chat" and '"quantization":"fp8"' in " ".join(_replica(after, "long-0")[1]["argv"])
    assert next(p for p in after["pools"] if p["name"] == "chat")["running_engine"] == adopted
    chat_again = next(p for p in restarted["pools"] if p["name"] == "chat")
    assert chat_again["engine"] == {"max_running_requests": 64} and chat_again["running_engine"] == adopted
    assert all('"quantization":"fp8"' in " ".join(_replica(restarted, name)[1]["argv"]) for name in ("chat-0", "chat-1"))
    assert _replica(restarted, "long-0")[0] == "long" and "fp8" not in " ".join(_replica(restarted, "long-0")[1]["argv"])
    assert "pool chat starts on the configuration its canary adopted" in again.log()


def _caching(state: dict[str, Any], name: str) -> bool:
    """Whether the replica's llama-server keeps and reuses its prompt cache."""
    argv = _replica(state, name)[1]["argv"]
    assert ("--cache-reuse" in argv) != ("--no-cache-prompt" in argv), argv
    return "--cache-reuse" in argv


@pytest.mark.slow
@pytest.mark.serial  # the verdict compares two replicas' speeds: another worker's load on the cores would be noise
def test_a_real_llamacpp_canary_adopts_a_better_configuration_and_rolls_back_a_worse_one(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    # Every request shares a ~250-token system prompt and asks for 4 tokens, so prefill is most of a request's
    # time: a replica that reuses its cached prompt answers ~2x faster (measured here: 0.9 s vs 2.0 s at 4
    # concurrent). Least-work routing balances the two replicas' outstanding work (prefix affinity would send
    # the shared prefix to one of them).
    pools = [{"name": "chat-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
              "engine": {"kind": "llamacpp", "threads": 1, "max_running_requests": 4, "enable_prefix_caching": False},
              "replicas": {"launch": 2}}]
    canary = {"window_s": 15, "min_requests": 10, "min_margin": 0.1}  # ~25 requests a side in the A/A window: a noise of ~0.35
    config = _config(tmp_path, pools, canary, {"replica_picker": "least_work"}, devices={"cpu": {"count": 2}})
    gateway = start_gateway(tmp_path, ["--config", str(config), "--replica-logs", str(tmp_path / "replicas")], timeout_s=180)
    try:
        with _Load(gateway.url, "tiny-llama", 4, num_threads=6, system="the sea " * 120) as load:
            _until(lambda: load.ok >= 6, 60, "load flowing")
            before = _admin(gateway.url, "/admin/state")[1]
            better = _trial(gateway, load, {"enable_prefix_caching": True}, 120)
            adopted = _admin(gateway.url, "/admin/state")[1]
            worse = _trial(gateway, load, {"enable_prefix_caching": False}, 120)
            kept = _admin(gateway.url, "/admin/state")[1]
    finally:
        gateway.stop()
    assert load.failed == [] and load.ok > 40 and load.replicas == {"chat-cpu-0", "chat-cpu-1"}
    verdicts = [d for d in better + worse if d["kind"] == "canary"]
    assert [(d["evidence"]["outcome"], d["evidence"]["noise_source"]) for d in verdicts] == [("adopt", "a/a"), ("roll back", "a/a")], verdicts
    assert [d["kind"] for d in better] == ["step", "canary", "step", "verify"], better
    assert [(d["kind"], d["evidence"].get("outcome")) for d in worse] == [
        ("step", None), ("canary", "roll back"), ("rollback", None), ("rollback", "restored")], worse
    assert not _caching(before, "chat-cpu-0") and not _caching(before, "chat-cpu-1")
    assert _caching(adopted, "chat-cpu-0") and _caching(adopted, "chat-cpu-1")  # the sibling followed the canary
    assert _caching(kept, "chat-cpu-0") and _caching(kept, "chat-cpu-1")  # the worse canary went back
    # both verdicts are in the log file with both sides' figures, the noise and the margin they were judged by
    logged = [read_decision(json.loads(line)) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    records = [d.evidence for d in logged if d is not None and isinstance(d.evidence, CanaryEvidence)]
    assert [r.outcome for r in records] == ["adopt", "roll back"]
    for record in records:
        assert record.canary == "chat-cpu-0" and record.siblings == ("chat-cpu-1",) and record.source == "operator"
        assert record.canary_figures["num_requests"] >= 10 and record.sibling_figures["chat-cpu-1"]["num_requests"] >= 10
        assert record.noise is not None and record.margin == max(0.1, record.noise) and record.gain is not None
        assert set(record.noise_figures or {}) == {"chat-cpu-0", "chat-cpu-1"}
    adopt, roll_back = records
    assert adopt.gain is not None and adopt.margin is not None and adopt.gain > adopt.margin
    assert roll_back.gain is not None and roll_back.margin is not None and roll_back.gain <= roll_back.margin
