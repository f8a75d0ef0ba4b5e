"""A config reload's circuit-breaker settings reach the replicas the new version keeps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gateway.config import load_config
from gateway.state import GatewayState
from tests.support.procs import write_tenant


def _config(tmp_path: Path, eject_after: int, cooldown_s: float) -> Path:
    path = tmp_path / "config.yaml"
    pools = [{"name": "main", "model": "llama-3.1-8b", "replicas": {"urls": ["http://127.0.0.1:9"]}}]
    upstream = {"eject_after_failures": eject_after, "eject_cooldown_s": cooldown_s}
    path.write_text(json.dumps({"tenants_dir": "tenants", "upstream": upstream, "fleet": {"pools": pools}}))
    return path


def test_a_reload_sets_the_kept_replicas_breakers_and_keeps_their_state(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "t", "sk-test-reload-breakers")
    state = GatewayState(load_config(_config(tmp_path, 5, 30.0)), {})
    breaker = state.runtime.pools[0].replicas[0].breaker
    assert not breaker.on_failure(0.0)  # one of five

    async def reload() -> None:
        state.apply(load_config(_config(tmp_path, 2, 1.0)))

    asyncio.run(reload())
    kept = state.runtime.pools[0].replicas[0].breaker
    assert kept is breaker and (kept.eject_after, kept.cooldown_s) == (2, 1.0)
    assert kept.on_failure(1.0)  # its earlier failure still counts: the second of two ejects it
    assert not kept.available(1.5) and kept.available(2.0)  # the new 1 s cool-down
