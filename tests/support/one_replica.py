"""A real gateway in front of one emulated replica, for the circuit breaker's tests: the fleet, a chat
request's status, and the replica's row of ``/admin/state``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.support.procs import Proc, gateway_over, start_emulator, write_tenant

MODEL, KEY, ADMIN = "llama-3.1-8b", "sk-test-one-replica", "admin-token-for-tests"


@contextmanager
def one_replica(tmp_path: Path, upstream: Mapping[str, object]) -> Iterator[tuple[Proc, Proc]]:
    """(gateway, emulator): one pool of every shape over the one replica, with these ``upstream`` settings."""
    emulator = start_emulator(tmp_path, "emu")
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "main", KEY, max_concurrency=100, rate_limits={"requests_per_min": 100000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "upstream": dict(upstream),
        "tenants_dir": "tenants",
        "fleet": {"pools": [{"name": "main", "model": MODEL, "shapes": ["short-chat", "long-context", "reasoning", "batch"],
                             "replicas": {"urls": [emulator.url]}}]},
    }
    with gateway_over(tmp_path, emulator, config) as gateway:
        yield gateway, emulator


def chat_status(gateway: Proc, stream: bool = False) -> int:
    """The HTTP status of a small chat completion through the gateway."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}).encode()
    request = urllib.request.Request(gateway.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


def replica_state(gateway: Proc) -> dict[str, object]:
    """The replica's row of ``/admin/state``: its health, failures, ejections."""
    request = urllib.request.Request(gateway.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())["pools"][0]["replicas"][0]  # type: ignore[no-any-return]
