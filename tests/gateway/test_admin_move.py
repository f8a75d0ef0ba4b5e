"""Operator moves (``POST /admin/move``): a launched replica is drained, restarted with another pool's
engine arguments on the same devices, verified and routed again, under continuous load, with 0
requests failed and every phase in the decision log; a start that fails is rolled back, 0 lost.

The emulated case runs anywhere; the llama.cpp case moves a real ``llama-server`` (the tiny model,
installed and cached by ``fleet.engines.install`` on first use) from ``--parallel 4`` to
``--parallel 1 -c 8192``."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.procs import Proc, start_gateway, write_tenant

KEY, ADMIN = "sk-test-move", "admin-token-move"


def _admin(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                     headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def _replica(state: dict[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    """(the pool it is routed in, or "" when unrouted; its process facts)."""
    for pool in state["pools"]:
        for replica in pool["replicas"]:
            if replica["name"] == name:
                return pool["name"], replica["process"]
    return "", {}


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.2)


class _Load:
    """Requests through the gateway from ``num_threads`` client threads until stopped: every outcome is counted.
    Each request's user message begins with its own number; ``system``, when given, is a system prompt they all share."""

    def __init__(self, url: str, model: str, max_tokens: int, num_threads: int = 2, system: str | None = None) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        self.model, self.max_tokens = model, max_tokens
        self.system: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.ok = 0
        self.failed: list[str] = []
        self.errors: list[openai.APIError] = []  # the same, as raised (status, headers, body)
        self.replicas: set[str] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_threads)]

    def __enter__(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model, messages=[*self.system, {"role": "user", "content": f"{self.ok + len(self.failed)}. Tell me about the sea."}],
                    max_tokens=self.max_tokens)
                raw.parse()
                self.ok += 1
                self.replicas.add(raw.headers["x-polymorph-replica"])
            except openai.APIError as exc:
                self.failed.append(repr(exc))
                self.errors.append(exc)


def _config(tmp_path: Path, pools: list[dict[str, Any]], **fleet: Any) -> Path:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "ops", KEY, max_concurrency=100, rate_limits={"requests_per_min": 1_000_000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {"pools": pools, **fleet, "controller": {"enabled": False, "decision_log": "decisions.jsonl"}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def _move_and_watch(gateway: Proc, replica: str, to_pool: str, model: str, max_tokens: int, timeout_s: float) -> tuple[_Load, list[dict[str, Any]]]:
    """Move under load until the decision log says it ended (verify, or a rollback's end)."""
    earlier = len(_admin(gateway.url, "/admin/decisions")[1]["decisions"])
    with _Load(gateway.url, model, max_tokens) as load:
        _until(lambda: load.ok >= 4, 60, "load flowing")
        status, answer = _admin(gateway.url, "/admin/move", {"replica": replica, "to_pool": to_pool})
        assert status == 202, answer
        assert [d["kind"] for d in answer["decisions"]] == ["step"]

        def ended() -> bool:
            entries = _admin(gateway.url, "/admin/decisions")[1]["decisions"][earlier:]
            kinds = [(d["kind"], d["evidence"].get("outcome")) for d in entries]
            return ("verify", None) in kinds or ("rollback", "restored") in kinds or ("rollback", "failed") in kinds

        _until(ended, timeout_s, "the move ends")
        seen = load.ok
        _until(lambda: load.ok >= seen + 4, 60, "load flowing after the move")
    return load, _admin(gateway.url, "/admin/decisions")[1]["decisions"]


def test_an_emulated_replica_moves_between_pools_under_load_without_failing_a_request(tmp_path: Path) -> None:
    pools = [
        {"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 64}, "replicas": {"emulated": 1}},
        {"name": "long", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["long-context"],
         "engine": {"max_running_requests": 8, "chunked_prefill_size": 8192}, "replicas": {"emulated": 1}},
        {"name": "big", "model": "llama-3.1-8b", "gpu": "H200", "shapes": ["reasoning"], "replicas": {"launch": 0}},
    ]
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, pools, emulator_speed=20.0))])
    try:
        # before, this moved: the H100 replica restarted with the H200 pool's configuration and counted as an H200
        other_kind = _admin(gateway.url, "/admin/move", {"replica": "chat-0", "to_pool": "big"})
        dry_run = _admin(gateway.url, "/admin/move", {"replica": "chat-0", "to_pool": "long", "dry_run": True})  # before: it moved
        before = _replica(_admin(gateway.url, "/admin/state")[1], "chat-0")
        load, decisions = _move_and_watch(gateway, "chat-0", "long", "llama-3.1-8b", 16, 60)
        after = _replica(_admin(gateway.url, "/admin/state")[1], "chat-0")
        refused = _admin(gateway.url, "/admin/move", {"replica": "chat-0", "to_pool": "long"})
        unknown = _admin(gateway.url, "/admin/move", {"replica": "nope", "to_pool": "long"})
        bad = _admin(gateway.url, "/admin/move", {"replica": "chat-0"})
    finally:
        gateway.stop()
    assert load.failed == [] and load.ok > 8
    assert before[0] == "chat" and after[0] == "long"
    assert '"max_running_requests":64' in " ".join(before[1]["argv"])
    assert '"chunked_prefill_size":8192' in " ".join(after[1]["argv"]) and after[1]["argv"] != before[1]["argv"]
    kinds = [d["kind"] for d in decisions]
    assert kinds == ["step", "verify"], kinds
    step, verify = decisions
    assert step["evidence"]["source"] == "operator" and step["evidence"]["moves"] == [["chat-0", "chat", "long"]]
    assert verify["evidence"]["ok"] is True and verify["evidence"]["start_to_healthy_s"] is not None
    assert refused[0] == 409 and "already serves" in refused[1]["error"]["message"]
    assert unknown[0] == 404 and bad[0] == 400 and bad[1]["error"]["param"] == "to_pool"
    assert dry_run[0] == 400 and dry_run[1]["error"]["param"] == "dry_run"
    assert other_kind[0] == 409 and "runs on H100-SXM and pool 'big' on H200" in other_kind[1]["error"]["message"]


def test_requests_read_while_a_moved_replica_comes_back_are_routed_on_the_pools_that_hold_it(tmp_path: Path) -> None:
    """A request takes the gateway's runtime when it arrives and routes after reading its body. Requests
    that arrive while the model's only replica is stopped for a move, and whose bodies finish after it is
    back in a pool, meet pools that hold it (the pool objects are shared) but a runtime whose name map
    does not: they are routed again on the newest runtime, not answered 500 (a KeyError the real
    llama.cpp canary test hit under load)."""
    pools = [
        {"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 64}, "replicas": {"emulated": 1}},
        {"name": "chat-next", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 32}, "replicas": {"launch": 0}},
    ]
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, pools, emulator_speed=20.0))])
    body = json.dumps({"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    port = int(gateway.url.rsplit(":", 1)[1])
    clients: list[socket.socket] = []
    try:
        status, answer = _admin(gateway.url, "/admin/move", {"replica": "chat-0", "to_pool": "chat-next"})
        assert status == 202, answer
        _until(lambda: _replica(_admin(gateway.url, "/admin/state")[1], "chat-0")[0] == "", 60, "chat-0 stopped")
        clients.extend(socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(12))
        for client in clients:
            client.sendall(head + body[:8])  # the handler runs, holding this runtime, and waits for the rest
        _until(lambda: _replica(_admin(gateway.url, "/admin/state")[1], "chat-0")[0] == "chat-next", 60, "chat-0 back, in chat-next")
        answers = []
        for client in clients:
            client.sendall(body[8:])
            answers.append(b"".join(iter(lambda c=client: c.recv(65536), b"")).decode(errors="replace"))  # type: ignore[misc]
    finally:
        for client in clients:  # also when a wait above failed: an open socket fails a later test's GC
            client.close()
        gateway.stop()
    statuses = [a.split(" ", 2)[1] for a in answers]
    assert statuses == ["200"] * len(clients), [a[:400] for a in answers if " 200 " not in a.split("\r\n", 1)[0]]
    served_by = {line.split(":", 1)[1].strip() for a in answers for line in a.split("\r\n") if line.lower().startswith("x-polymorph-replica:")}
    assert served_by == {"chat-0"}, served_by  # the model's only replica, absent from the runtime each request took
    assert "KeyError" not in gateway.log()


@pytest.mark.slow
@pytest.mark.parametrize("actuator", ["local", "ray"])  # ungrouped: it runs with the engine tests, last, after the other Ray tests
def test_a_real_llamacpp_replica_moves_to_other_arguments_and_a_failed_start_rolls_back(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path, actuator: str) -> None:
    """The same moves through either actuator: local processes, or Ray actors on a local cluster (one logical GPU a replica)."""
    if actuator == "ray":
        pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make test installs it)")
    llama = {"kind": "llamacpp", "threads": 1}
    pools = [
        {"name": "chat-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
         "engine": {**llama, "max_running_requests": 4}, "replicas": {"launch": 1}},
        {"name": "long-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["long-context"],
         "engine": {**llama, "max_running_requests": 1, "max_total_tokens": 8192}, "replicas": {"launch": 1}},
        # a pool whose engine cannot start: llama-server refuses the flag and exits
        {"name": "broken-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["batch"],
         "engine": {**llama, "args": ["--no-such-flag"]}, "replicas": {"launch": 0}},
    ]
    config = _config(tmp_path, pools, devices={"cpu": {"count": 2}}, actuator=actuator)
    gateway = start_gateway(tmp_path, ["--config", str(config), "--replica-logs", str(tmp_path / "replicas")], timeout_s=180)
    try:
        before = _replica(_admin(gateway.url, "/admin/state")[1], "chat-cpu-0")
        load, decisions = _move_and_watch(gateway, "chat-cpu-0", "long-cpu", "tiny-llama", 8, 120)
        after = _replica(_admin(gateway.url, "/admin/state")[1], "chat-cpu-0")
        failing, more = _move_and_watch(gateway, "long-cpu-0", "broken-cpu", "tiny-llama", 8, 120)
        restored = _replica(_admin(gateway.url, "/admin/state")[1], "long-cpu-0")
    finally:
        gateway.stop()
    assert load.failed == [] and failing.failed == []
    argv_before, argv_after = before[1]["argv"], after[1]["argv"]
    assert before[0] == "chat-cpu" and after[0] == "long-cpu"
    assert argv_before[argv_before.index("--parallel") + 1] == "4" and "-c" not in argv_before
    assert argv_after[argv_after.index("--parallel") + 1] == "1" and argv_after[argv_after.index("-c") + 1] == "8192"
    assert after[1]["devices"] == before[1]["devices"] and after[1]["healthy"] is True
    assert [d["kind"] for d in decisions] == ["step", "verify"]
    # the failed start: rolled back to its pool and arguments, with the evidence of why
    kinds = [(d["kind"], d["evidence"].get("outcome")) for d in more[2:]]
    assert kinds == [("step", None), ("rollback", None), ("rollback", "restored")], kinds
    assert more[3]["evidence"]["reason"] == "replica never became healthy" and more[3]["evidence"]["never_healthy"] == ["long-cpu-0"]
    assert restored[0] == "long-cpu" and "--no-such-flag" not in restored[1]["argv"] and restored[1]["healthy"] is True


def test_a_reload_that_changes_the_launched_fleet_is_refused_and_the_rest_applies_once_reverted(tmp_path: Path) -> None:
    """Before, a renamed pool was "applied" (the version went up) while the loop kept the old pools, and an
    alias checked against the new pools pointed at a model no running pool served."""
    pools = [{"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"], "replicas": {"emulated": 1}}]
    path = _config(tmp_path, pools, emulator_speed=20.0)
    gateway = start_gateway(tmp_path, ["--config", str(path)])
    original = json.loads(path.read_text())
    try:
        version = _admin(gateway.url, "/admin/state")[1]["config"]["version"]
        renamed = json.loads(path.read_text())
        renamed["fleet"]["pools"][0]["name"] = "chat-renamed"
        renamed["aliases"] = {"gpt-4o": "llama-3.1-8b"}
        path.write_text(json.dumps(renamed))
        gateway.process.send_signal(signal.SIGHUP)
        _until(lambda: "config reload rejected" in gateway.log(), 30, "the reload is refused")
        refused = _admin(gateway.url, "/admin/state")[1]
        path.write_text(json.dumps({**original, "aliases": {"gpt-4o": "llama-3.1-8b"}}))  # the fleet as it runs, the alias kept
        gateway.process.send_signal(signal.SIGHUP)
        _until(lambda: _admin(gateway.url, "/admin/state")[1]["config"]["version"] > version, 30, "the reverted version applies")
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30) as client:
            aliased = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi."}], max_tokens=2)
    finally:
        gateway.stop()
    assert refused["config"]["version"] == version and [p["name"] for p in refused["pools"]] == ["chat"]
    assert "fleet.pools: the fleet is the control loop's while the gateway runs" in gateway.log()
    assert aliased.choices[0].message.content is not None
