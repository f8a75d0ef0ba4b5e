"""Cost per tenant and monthly budgets, through real gateways (`polymorph serve` with emulated replicas)
and the real openai SDK: a tenant over its budget gets 429 budget_exceeded, another is unaffected, the
spend survives a reload, and with `--workers 2` one spend holds for both workers."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.budgets import SharedSpendLedger, SpendLedger, budget_refusal, period_of
from gateway.config import Tenant, load_config
from gateway.limits_shared import SharedLimitTable, SharedTenantLimiter
from kernels.yamlsrc import ConfigError
from tests.support.procs import Proc, running, start_gateway, write_tenant
from tests.support.redis import RedisServer

MODEL = "llama-3.1-8b"
THRIFTY_KEY, RICH_KEY = "sk-test-thrifty", "sk-test-rich"
ADMIN_TOKEN = "admin-token-budgets"
MESSAGES = [{"role": "user", "content": "Say hello."}]


def _write_tenants(tmp: Path, thrifty_budget_usd: float) -> None:
    tenants = tmp / "tenants"
    tenants.mkdir(exist_ok=True)
    write_tenant(tenants, "thrifty", THRIFTY_KEY, budget={"monthly_usd": thrifty_budget_usd})
    write_tenant(tenants, "rich", RICH_KEY)


def _config(tmp: Path, thrifty_budget_usd: float, body_read_timeout_s: float = 30.0, limits: dict[str, object] | None = None) -> Path:
    _write_tenants(tmp, thrifty_budget_usd)
    config = {
        "server": {"host": "127.0.0.1", "access_log": True, "admin_token": ADMIN_TOKEN, "body_read_timeout_s": body_read_timeout_s},
        "tenants_dir": "tenants",
        # a replica-hour at a million USD, emulated 20 times faster than wall time: about 5,600 USD per
        # wall second of a replica, so a few short requests spend the budget
        "fleet": {"pools": [{"name": "chat", "model": MODEL, "gpu": "H100-SXM", "price_per_hour_usd": 1e6, "replicas": {"emulated": 1}}],
                  "emulator_speed": 20.0},
    }
    if limits is not None:
        config["limits"] = limits
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def _client(gateway: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def _get(gateway: Proc, path: str) -> bytes:
    request = urllib.request.Request(gateway.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return bytes(resp.read())


def _state(gateway: Proc) -> dict[str, object]:
    return dict(json.loads(_get(gateway, "/admin/state")))


def _spend(gateway: Proc, tenant: str) -> dict[str, object]:
    tenants = _state(gateway)["tenants"]
    assert isinstance(tenants, list)
    return dict(next(t["spend"] for t in tenants if t["name"] == tenant))


def _samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` in a Prometheus text exposition: their labels and values."""
    out = []
    for found in re.finditer(rf"^{name}{{(.*)}} (\S+)$", metrics, re.M):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', found[1])), float(found[2])))
    return out


def _wait_for_version(gateway: Proc, version: int) -> None:
    deadline = time.monotonic() + 30
    while _state(gateway)["config"]["version"] != version:  # type: ignore[index]
        assert time.monotonic() < deadline, f"config version {version} was never applied: {gateway.log()[-2000:]}"
        time.sleep(0.2)


def _spend_until_refused(client: openai.OpenAI, max_requests: int = 200) -> tuple[int, openai.RateLimitError]:
    """Chats until the budget refuses one: how many were served, and the refusal."""
    for served in range(max_requests):
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        except openai.RateLimitError as refusal:
            return served, refusal
    raise AssertionError(f"{max_requests} requests never spent the budget")


def test_a_tenant_over_its_budget_is_refused_others_are_not_and_the_spend_survives_reloads(tmp_path: Path) -> None:
    config = _config(tmp_path, thrifty_budget_usd=50.0)
    gateway = start_gateway(tmp_path, ["--config", str(config)])
    with running(gateway), _client(gateway, THRIFTY_KEY) as thrifty, _client(gateway, RICH_KEY) as rich:
        served, refusal = _spend_until_refused(thrifty)
        assert served >= 1
        assert refusal.status_code == 429 and refusal.code == "budget_exceeded"
        assert refusal.body["type"] and "50 USD budget" in refusal.body["message"]  # type: ignore[index]
        period = period_of(time.time())
        assert int(refusal.response.headers["Retry-After"]) == pytest.approx(period.end_s - time.time(), abs=5)
        for _ in range(3):  # the other tenant keeps being served
            assert rich.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8).choices  # type: ignore[arg-type]
        spent = _spend(gateway, "thrifty")
        assert spent["period"] == period.key and spent["budget_usd"] == 50.0 and spent["remaining_usd"] == 0.0
        assert isinstance(spent["spent_usd"], float) and spent["spent_usd"] >= 50.0
        assert _spend(gateway, "rich")["budget_usd"] is None
        metrics = _get(gateway, "/metrics").decode()
        costs = {(labels["tenant"], labels["pool"]): value for labels, value in _samples(metrics, "polymorph_tenant_cost_usd_total")}
        assert set(costs) == {("thrifty", "chat"), ("rich", "chat")} and all(v > 0 for v in costs.values())
        assert costs[("thrifty", "chat")] == pytest.approx(spent["spent_usd"])
        assert [(labels, value) for labels, value in _samples(metrics, "polymorph_tenant_budget_remaining_usd")] == [({"tenant": "thrifty"}, 0.0)]

        _config(tmp_path, thrifty_budget_usd=50.0, body_read_timeout_s=20.0)  # the config changes, the budget does not
        _wait_for_version(gateway, 2)
        assert _spend(gateway, "thrifty")["spent_usd"] == spent["spent_usd"]  # not reset
        with pytest.raises(openai.RateLimitError) as still_refused:
            thrifty.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        assert still_refused.value.code == "budget_exceeded"

        _write_tenants(tmp_path, thrifty_budget_usd=1000.0)  # a raised budget lets it through again
        _wait_for_version(gateway, 3)
        assert thrifty.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8).choices  # type: ignore[arg-type]
        after = _spend(gateway, "thrifty")
        assert isinstance(after["spent_usd"], float) and after["spent_usd"] > spent["spent_usd"]
        assert after["budget_usd"] == 1000.0
        time.sleep(0.5)  # the access log flushes every 0.25 s
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith('{"ts"')]
    assert all(line["cost_usd"] > 0 for line in lines if line["status"] == 200)
    assert all(line["cost_usd"] == 0 for line in lines if line["status"] == 429)


async def _one_chat_per_connection(url: str, key: str, num_requests: int) -> list[tuple[int, str | None]]:
    """Sequential chats, each on its own connection (the kernel spreads them over the workers)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    answers: list[tuple[int, str | None]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(num_requests):
            async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                payload = await resp.read()
                answers.append((resp.status, json.loads(payload)["error"]["code"] if resp.status != 200 else None))
    return answers


def test_with_two_workers_the_budget_holds_across_both(tmp_path: Path) -> None:
    config = _config(tmp_path, thrifty_budget_usd=0.001)  # the first request spends it (YAML reads 1e-06 as a string)
    gateway = start_gateway(tmp_path, ["--config", str(config), "--workers", "2"], timeout_s=60.0)
    with running(gateway):
        answers = asyncio.run(_one_chat_per_connection(gateway.url, THRIFTY_KEY, 12))
        spent = _spend(gateway, "thrifty")
    # one spend for both workers: each worker keeping its own would have let one request through on each
    assert answers == [(200, None)] + [(429, "budget_exceeded")] * 11, answers
    assert isinstance(spent["spent_usd"], float) and spent["spent_usd"] > 0.001


def test_two_gateways_share_one_spend_through_redis(tmp_path: Path, redis: RedisServer) -> None:
    import redis as redis_client

    config = _config(tmp_path, thrifty_budget_usd=0.001, limits={"store": redis.url, "num_gateways": 2, "call_timeout_s": 1.0})
    gateways = [start_gateway(tmp_path, ["--config", str(config)], name=f"gateway{i}") for i in range(2)]
    with running(*gateways), _client(gateways[0], THRIFTY_KEY) as first, _client(gateways[1], THRIFTY_KEY) as second:
        assert first.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8).choices  # type: ignore[arg-type]
        key = f"polymorph:spend:thrifty:{period_of(time.time()).key}"
        store = redis_client.Redis.from_url(redis.url)
        deadline = time.monotonic() + 10
        while store.get(key) is None:  # the charge is sent after the response
            assert time.monotonic() < deadline, "the first gateway's charge never reached the store"
            time.sleep(0.05)
        total: Any = store.get(key)
        ttl_s: Any = store.ttl(key)
        assert float(total) > 0.001 and 0 < ttl_s <= period_of(time.time()).end_s - time.time() + 86400 + 5  # a day past the month
        store.close()
        with pytest.raises(openai.RateLimitError) as refused:  # the second gateway has charged nothing itself
            second.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        assert refused.value.code == "budget_exceeded"
        assert _spend(gateways[1], "thrifty")["spent_usd"] == pytest.approx(float(total), abs=1e-6)  # the store's figure, not its own
        redis.kill()  # without the store each gateway keeps the last total it read, and its own charges
        with pytest.raises(openai.RateLimitError) as still_refused:
            second.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        assert still_refused.value.code == "budget_exceeded"


def test_the_ledger_starts_afresh_each_utc_month() -> None:
    wall = [datetime(2026, 12, 31, 23, 59, 0, tzinfo=UTC).timestamp()]
    ledger = SpendLedger(lambda: wall[0])
    tenant = Tenant("t", frozenset(), None, ("standard",), "standard", {}, 60, 6000, 4, budget_monthly_usd=2.0)
    ledger.add("t", 1.5)
    assert budget_refusal(ledger, tenant, wall[0]) is None
    ledger.add("t", 0.5)
    refusal = budget_refusal(ledger, tenant, wall[0])
    assert refusal is not None and refusal.code == "budget_exceeded" and refusal.retry_after_s == pytest.approx(60.0)
    assert "2026-12" in refusal.message and "2027-01-01T00:00:00Z" in refusal.message
    wall[0] += 61.0  # a new month
    assert ledger.period().key == "2027-01" and ledger.spent_usd("t") == 0.0 and budget_refusal(ledger, tenant, wall[0]) is None


def test_workers_charge_one_shared_slot_which_starts_afresh_each_month() -> None:
    wall = [datetime(2026, 12, 31, 23, 59, 0, tzinfo=UTC).timestamp()]
    tenant = Tenant("t", frozenset(), None, ("standard",), "standard", {}, 60, 6000, 4, budget_monthly_usd=2.0)
    table = SharedLimitTable.create(num_rows=8)
    sibling = SharedLimitTable.attach(table.handle)  # what a second worker maps
    try:
        a, b = SharedSpendLedger(table, (tenant,), 0.0, lambda: wall[0]), SharedSpendLedger(sibling, (tenant,), 0.0, lambda: wall[0])
        a.add("t", 1.25)
        b.add("t", 0.75)
        assert a.spent_usd("t") == b.spent_usd("t") == pytest.approx(2.0)
        refusal = budget_refusal(b, tenant, wall[0])
        assert refusal is not None and refusal.code == "budget_exceeded"
        # the charges share the tenant's rate-limit row and leave its buckets alone: a minute's burst of 60 is all there
        limiter = SharedTenantLimiter(table, tenant, now=0.0)
        for _ in range(60):
            assert limiter.admit(1, now=0.0) is None
            limiter.release()
        assert limiter.admit(1, now=0.0) is not None
        wall[0] += 61.0
        assert a.spent_usd("t") == 0.0 and budget_refusal(a, tenant, wall[0]) is None
        b.add("t", 0.5)
        assert a.spent_usd("t") == pytest.approx(0.5)
    finally:
        sibling.close()
        table.close()


def test_a_bad_budget_or_price_names_file_line_and_field(tmp_path: Path) -> None:
    config = _config(tmp_path, thrifty_budget_usd=0.5)
    (tmp_path / "tenants" / "thrifty.yaml").write_text('name: thrifty\napi_key_sha256: ["' + "a" * 64 + '"]\nbudget:\n  monthly_usd: lots\n')
    with pytest.raises(ConfigError, match=r"thrifty\.yaml:4: budget\.monthly_usd: must be a number, not 'lots'"):
        load_config(config)
    (tmp_path / "tenants" / "thrifty.yaml").write_text('name: thrifty\napi_key_sha256: ["' + "a" * 64 + '"]\nbudget: {monthly_usd: -1}\n')
    with pytest.raises(ConfigError, match=r"thrifty\.yaml:3: budget\.monthly_usd: must be between 0"):
        load_config(config)
    _write_tenants(tmp_path, 0.5)
    config.write_text(config.read_text().replace('"price_per_hour_usd": 1000000.0', '"price_per_hour_usd": "free"'))
    with pytest.raises(ConfigError, match=r"config\.yaml:1: fleet\.pools\[0\]\.price_per_hour_usd: must be a number"):
        load_config(config)
