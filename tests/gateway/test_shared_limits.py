"""Tenant limits that hold across processes and hosts: the shared-memory table of `--workers N`, a real
Redis (Debian's redis-server) shared by two gateways, and the fallback while Redis is gone.

Each request opens its own connection, so the kernel spreads them over the workers (SO_REUSEPORT); with a
limiter per process, `--workers 2` let 130 of 200 requests through a 60 requests/minute tenant.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from gateway.admission import TenantLimiter
from gateway.config import Tenant, load_config
from gateway.limits_shared import SharedLimitTable, SharedTenantLimiter
from kernels.yamlsrc import ConfigError
from tests.support.procs import Proc, running, set_faults, start_emulator, start_gateway, write_tenant
from tests.support.redis import RedisServer

MODEL = "llama-3.1-8b"
RATED_KEY, CAPPED_KEY = "sk-test-rated", "sk-test-capped"
NUM_REQUESTS = 200
TENANT = Tenant("t", frozenset(), None, ("standard",), "standard", {}, requests_per_min=60, tokens_per_min=6000, max_concurrency=2)


# --- the shared table's arithmetic, with an injected clock ----------------------------------------------


@pytest.fixture
def table() -> Iterator[SharedLimitTable]:
    owner = SharedLimitTable.create(num_rows=8)
    yield owner
    owner.close()


def test_two_attachments_share_one_budget(table: SharedLimitTable) -> None:
    sibling = SharedLimitTable.attach(table.handle)  # what a second worker maps
    try:
        a, b = SharedTenantLimiter(table, TENANT, now=0.0), SharedTenantLimiter(sibling, TENANT, now=0.0)
        admitted = 0
        for i in range(100):
            limiter = (a, b)[i % 2]
            if limiter.admit(1, now=0.0) is None:
                admitted += 1
                limiter.release()
        assert admitted == 60  # the burst is one minute's allowance, once for both
        refusal = b.admit(1, now=0.0)
        assert refusal is not None and refusal.code == "rate_limit_exceeded" and refusal.retry_after_s == pytest.approx(1.0)
        assert a.admit(1, now=1.0) is None and b.admit(1, now=1.0) is not None  # one more second, one more request
        a.release()
        assert b.admit(1, now=3.0) is None and a.admit(1, now=3.0) is None  # two seconds, two
        assert a.num_in_flight == b.num_in_flight == 2
        refusal = b.admit(1, now=100.0)
        assert refusal is not None and refusal.code == "concurrency_limit_exceeded"  # the cap of 2, held across both
        a.release()
        assert b.num_in_flight == 1 and b.admit(1, now=100.0) is None
    finally:
        sibling.close()


def test_tokens_are_shared_and_a_refusal_takes_nothing(table: SharedLimitTable) -> None:
    a, b = SharedTenantLimiter(table, TENANT, now=0.0), SharedTenantLimiter(table, TENANT, now=0.0)
    assert a.admit(5000, now=0.0) is None
    refusal = b.admit(2000, now=0.0)
    assert refusal is not None and refusal.code == "token_rate_limit_exceeded" and refusal.retry_after_s == pytest.approx(10.0)
    assert b.admit(1000, now=0.0) is None  # the refused 2000 were not taken
    assert b.num_in_flight == 2
    # the same decisions as one process's limiter makes
    local = TenantLimiter(TENANT, now=0.0)
    assert local.admit(5000, 0.0) is None and local.admit(2000, 0.0) == refusal


def test_new_limits_reset_the_row_once_and_keep_the_in_flight_count(table: SharedLimitTable) -> None:
    uncapped = replace(TENANT, max_concurrency=1000)
    a = SharedTenantLimiter(table, uncapped, now=0.0)
    for _ in range(60):
        assert a.admit(1, now=0.0) is None
    assert SharedTenantLimiter(table, uncapped, now=0.0).admit(1, now=0.0) is not None  # same limits: the spent budget stays spent
    raised = replace(uncapped, requests_per_min=120)
    first = SharedTenantLimiter(table, raised, now=0.0)  # one worker reloads: full buckets of the new size
    second = SharedTenantLimiter(table, raised, now=0.0)  # its sibling reloads after it: no second reset
    assert first.num_in_flight == 60
    assert sum(first.admit(1, now=0.0) is None for _ in range(100)) == 100
    assert sum(second.admit(1, now=0.0) is None for _ in range(100)) == 20


def test_the_limits_section_is_validated_with_file_and_line(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "t", RATED_KEY)
    base = 'tenants_dir: tenants\nfleet:\n  pools:\n    - {name: main, model: llama-3.1-8b, replicas: {urls: ["http://127.0.0.1:9"]}}\n'
    path = tmp_path / "config.yaml"
    for section, complaint in (
        ("limits:\n  store: http://127.0.0.1:6379\n", r"config\.yaml:6: limits\.store: must be a Redis URL"),
        ("limits:\n  store: redis://127.0.0.1:6379/0\n  num_gateways: 0\n", r"config\.yaml:7: limits\.num_gateways: must be between 1"),
        ("limits:\n  num_gateways: 2\n", r"config\.yaml:5: limits: its fields configure the shared store"),
    ):
        path.write_text(base + section)
        with pytest.raises(ConfigError, match=complaint):
            load_config(path)
    path.write_text(base + "limits: {store: 'redis://127.0.0.1:6379/0', num_gateways: 3, key_prefix: pm}\n")
    limits = load_config(path).limits
    assert (limits.store, limits.num_gateways, limits.key_prefix, limits.call_timeout_s) == ("redis://127.0.0.1:6379/0", 3, "pm", 0.05)


# --- real gateways, a real Redis ----------------------------------------------------------------------


def _config(tmp: Path, emulator_url: str, limits: dict[str, object] | None = None) -> Path:
    tenants = tmp / "tenants"
    tenants.mkdir(exist_ok=True)
    write_tenant(tenants, "rated", RATED_KEY, max_concurrency=1000, rate_limits={"requests_per_min": 60})
    write_tenant(tenants, "capped", CAPPED_KEY, max_concurrency=4, rate_limits={"requests_per_min": 100000})
    config: dict[str, object] = {
        "server": {"host": "127.0.0.1", "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {"pools": [{"name": "main", "model": MODEL, "shapes": ["short-chat", "long-context", "reasoning", "batch"],
                             "replicas": {"urls": [emulator_url]}}]},
    }
    if limits is not None:
        config["limits"] = limits
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))
    return path


async def _send(urls: list[str], key: str, num_requests: int, concurrency: int) -> list[tuple[int, dict[str, str]]]:
    """``num_requests`` chats round-robin over ``urls``, ``concurrency`` at a time, each on a new connection."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1}
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as session:

        async def one(i: int) -> tuple[int, dict[str, str]]:
            async with slots, session.post(urls[i % len(urls)] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                payload = await resp.read()
                headers = dict(resp.headers)
                if resp.status == 429:
                    headers["code"] = json.loads(payload)["error"]["code"]
                return resp.status, headers

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def _check_rate(answers: list[tuple[int, dict[str, str]]], limit: int) -> None:
    statuses = [status for status, _ in answers]
    admitted = statuses.count(200)
    assert limit * 0.95 <= admitted <= limit * 1.05, f"{admitted} of {len(answers)} admitted against a limit of {limit}"
    assert statuses.count(429) == len(answers) - admitted
    assert all(h["code"] == "rate_limit_exceeded" and float(h["Retry-After"]) > 0 for status, h in answers if status == 429)


def _check_cap(answers: list[tuple[int, dict[str, str]]], cap: int) -> None:
    statuses = [status for status, _ in answers]
    assert statuses.count(200) == cap, statuses
    assert all(h["code"] == "concurrency_limit_exceeded" for status, h in answers if status == 429)


def _store(redis: RedisServer) -> dict[str, object]:
    # a generous call timeout: a busy test machine can take longer than the default 50 ms to answer,
    # and what is under test here is the sharing (a killed store refuses connections at once)
    return {"store": redis.url, "num_gateways": 2, "call_timeout_s": 1.0}


def _metrics(gateway: Proc) -> str:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize("num_workers", [2])  # two prove the sharing; each more costs a classifier load (seconds on 2 cores)
def test_workers_share_one_budget_per_tenant(tmp_path: Path, num_workers: int) -> None:
    emulator = start_emulator(tmp_path, "emu")
    with running(emulator):
        gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, emulator.url)), "--workers", str(num_workers)],
                                timeout_s=30.0 * num_workers)  # each worker loads the classifier: slow on a busy machine
        with running(gateway):
            tables = _limit_tables(gateway.process.pid)
            assert len(tables) == 1
            _check_rate(asyncio.run(_send([gateway.url], RATED_KEY, NUM_REQUESTS, 16)), 60)
            set_faults(emulator.url, hang_before_first_byte_s=2.0)  # slow requests: the cap, not the rate, binds
            _check_cap(asyncio.run(_send([gateway.url], CAPPED_KEY, 24, 24)), 4)
        assert gateway.process.returncode == 0
    assert not any((Path("/dev/shm") / name).exists() for name in tables)  # the table is removed when the gateway stops


def _limit_tables(pid: int) -> set[str]:
    """The limit tables a process has mapped (not all of /dev/shm: other tests' gateways may run beside it)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in maps if "/dev/shm/polymorph-limits-" in line}


def test_two_gateways_share_one_budget_through_redis(tmp_path: Path, redis: RedisServer) -> None:
    emulator = start_emulator(tmp_path, "emu")
    with running(emulator):
        config = _config(tmp_path, emulator.url, _store(redis))
        gateways = [start_gateway(tmp_path, ["--config", str(config)], name=f"gateway{i}") for i in range(2)]
        with running(*gateways):
            urls = [g.url for g in gateways]
            _check_rate(asyncio.run(_send(urls, RATED_KEY, NUM_REQUESTS, 16)), 60)
            set_faults(emulator.url, hang_before_first_byte_s=2.0)
            _check_cap(asyncio.run(_send(urls, CAPPED_KEY, 24, 24)), 4)
            assert all(re.search(r"^polymorph_limits_store_up 1\.0$", _metrics(g), re.M) for g in gateways)


def test_without_redis_a_gateway_keeps_its_share_and_returns_when_redis_does(tmp_path: Path, redis: RedisServer) -> None:
    emulator = start_emulator(tmp_path, "emu")
    with running(emulator):
        config = _config(tmp_path, emulator.url, _store(redis))
        gateway = start_gateway(tmp_path, ["--config", str(config)])
        with running(gateway):
            answers = asyncio.run(_send([gateway.url], RATED_KEY, 10, 4))
            assert [status for status, _ in answers] == [200] * 10
            redis.kill()
            # the first request to find the store gone is the fallback's first: served, and the share holds
            _check_rate(asyncio.run(_send([gateway.url], RATED_KEY, 100, 8)), 30)  # 60 per minute over 2 gateways
            metrics = _metrics(gateway)
            assert re.search(r"^polymorph_limits_store_up 0\.0$", metrics, re.M)
            assert re.search(r"^polymorph_limits_store_fallbacks_total 1\.0$", metrics, re.M)
            assert re.search(r"limits store redis://\S+ unreachable \(.+\); this gateway process now keeps 1/2 of each tenant's limits", gateway.log())
            redis.start()  # empty: no persistence
            deadline = time.monotonic() + 10
            while not re.search(r"^polymorph_limits_store_up 1\.0$", _metrics(gateway), re.M):
                assert time.monotonic() < deadline, "the gateway did not go back to the store"
                time.sleep(0.1)
            assert "answers again" in gateway.log()
            _check_rate(asyncio.run(_send([gateway.url], RATED_KEY, 100, 8)), 60)  # the store's fresh budget, whole


def test_a_dead_gateways_requests_stop_counting_when_its_lease_lapses(tmp_path: Path, redis: RedisServer) -> None:
    emulator = start_emulator(tmp_path, "emu")
    with running(emulator):
        config = _config(tmp_path, emulator.url, {**_store(redis), "lease_ttl_s": 2})
        doomed, survivor = (start_gateway(tmp_path, ["--config", str(config)], name=f"gateway{i}") for i in range(2))
        with running(doomed, survivor):
            set_faults(emulator.url, hang_before_first_byte_s=3.0)

            async def hold_then_kill() -> list[tuple[int, dict[str, str]]]:
                held = asyncio.ensure_future(_send([doomed.url], CAPPED_KEY, 4, 4))  # the whole cap, in flight on the doomed gateway
                await asyncio.sleep(1.0)
                doomed.kill()
                refused = await _send([survivor.url], CAPPED_KEY, 1, 1)
                await asyncio.gather(held, return_exceptions=True)  # their connections die with the gateway
                return refused

            refused = asyncio.run(hold_then_kill())
            assert [(status, h["code"]) for status, h in refused] == [(429, "concurrency_limit_exceeded")]
            deadline = time.monotonic() + 10
            while asyncio.run(_send([survivor.url], CAPPED_KEY, 1, 1))[0][0] != 200:  # admitted once the lease lapses
                assert time.monotonic() < deadline, "the dead gateway's requests still count"
                time.sleep(0.3)
