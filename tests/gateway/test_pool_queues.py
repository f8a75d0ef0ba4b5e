"""Live pool queues: a real gateway in front of a real emulated replica that runs one request at a time.

A request held inside the replica (a hang fault) fills the pool; the next ones wait in the pool's
queue, by tier priority, until it ends (its client disconnects). Interactive requests are served
ahead of batch ones that came first, batch is shed with 429 and Retry-After once its wait budget
(half its TTFT objective) passes, a client that leaves while waiting leaves the queue at once, and
every request gets an answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc, gateway_over, set_faults, start_emulator, write_tenant

KEY = "sk-test-queues"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@contextmanager
def _deployment(tmp: Path, batch_ttft_s: float) -> Iterator[tuple[Proc, Proc]]:
    (tmp / "tenants").mkdir()
    write_tenant(tmp / "tenants", "q", KEY, tiers=["interactive", "batch"], max_concurrency=100, rate_limits={"requests_per_min": 100_000})
    emulator = start_emulator(tmp, "replica")
    config = {
        "server": {"access_log": True},
        "tenants_dir": "tenants",
        "tiers": {
            "interactive": {"ttft_p99_s": 600.0, "tpot_p99_s": 10.0, "priority": 0},
            "batch": {"ttft_p99_s": batch_ttft_s, "tpot_p99_s": 10.0, "priority": 2},
        },
        # one replica the gateway admits one request at a time to
        "fleet": {"pools": [{"name": "p", "model": "llama-3.1-8b", "max_in_flight_per_replica": 1, "replicas": {"urls": [emulator.url]}}]},
    }
    with gateway_over(tmp, emulator, config) as gateway:
        yield gateway, emulator


async def _chat(session: aiohttp.ClientSession, url: str, tier: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {KEY}", "x-polymorph-tier": tier}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def _samples(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def _until(session: aiohttp.ClientSession, url: str, check: Callable[[Samples], bool], what: str) -> Samples:
    """Poll the gateway's metrics until ``check`` holds (the test fails after 30 s without it)."""
    deadline = time.monotonic() + 30.0
    while True:
        samples = await _samples(session, url)
        if check(samples):
            return samples
        assert time.monotonic() < deadline, f"never saw: {what}"
        await asyncio.sleep(0.02)


def _depth(samples: Samples, tier: str) -> float:
    return _value(samples, "polymorph_pool_queue_depth", pool="p", tier=tier)


async def _fill_the_pool(session: aiohttp.ClientSession, gateway: Proc, emulator: Proc) -> asyncio.Task[Any]:
    """A request the replica holds until its client leaves: the pool's only slot is taken."""
    set_faults(emulator.url, hang_before_first_byte_s=-1)
    blocker = asyncio.create_task(_chat(session, gateway.url, "interactive"))
    await _until(session, gateway.url, lambda s: _value(s, "polymorph_requests_in_flight", pool="p") == 1, "the blocker in flight")
    return blocker


async def _free_the_pool(blocker: asyncio.Task[Any], emulator: Proc) -> None:
    set_faults(emulator.url, reset=True)
    blocker.cancel()  # its client disconnects: the gateway ends it, and the pool's slot goes to the queue's head


def _served_tiers(gateway: Proc) -> list[str]:
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    return [line["tier"] for line in lines if line["status"] == 200]


def test_interactive_waits_ahead_of_batch_and_every_request_is_answered(tmp_path: Path) -> None:
    async def scenario(gateway: Proc, emulator: Proc) -> list[tuple[str, int]]:
        async with aiohttp.ClientSession() as session:
            blocker = await _fill_the_pool(session, gateway, emulator)
            waiting = []
            for tier in ("batch", "batch", "interactive", "interactive"):  # batch first
                waiting.append((tier, asyncio.create_task(_chat(session, gateway.url, tier))))
                parked = sum(1 for t, _ in waiting if t == tier)
                await _until(session, gateway.url, lambda s, tier=tier, n=parked: _depth(s, tier) == n, f"{parked} {tier} waiting")
            await _free_the_pool(blocker, emulator)
            answers = [(tier, (await task)[0]) for tier, task in waiting]
            after = await _until(session, gateway.url, lambda s: _depth(s, "interactive") + _depth(s, "batch") == 0, "an empty queue")
        assert _value(after, "polymorph_pool_queue_waits_total", pool="p", tier="interactive") == 2
        assert _value(after, "polymorph_pool_queue_waits_total", pool="p", tier="batch") == 2
        assert _value(after, "polymorph_pool_queue_wait_seconds_count", pool="p", tier="batch") == 2
        return answers

    with _deployment(tmp_path, batch_ttft_s=600.0) as (gateway, emulator):
        answers = asyncio.run(scenario(gateway, emulator))
    assert answers == [("batch", 200), ("batch", 200), ("interactive", 200), ("interactive", 200)]  # nothing lost
    # one request at a time from the queue: the access log's order is the order they were served in
    assert _served_tiers(gateway) == ["interactive", "interactive", "batch", "batch"]


def test_batch_is_shed_at_its_deadline_and_a_client_that_leaves_leaves_the_queue(tmp_path: Path) -> None:
    async def scenario(gateway: Proc, emulator: Proc) -> None:
        async with aiohttp.ClientSession() as session:
            blocker = await _fill_the_pool(session, gateway, emulator)
            interactive = asyncio.create_task(_chat(session, gateway.url, "interactive"))
            await _until(session, gateway.url, lambda s: _depth(s, "interactive") == 1, "interactive waiting")
            status, headers, body = await _chat(session, gateway.url, "batch")  # waits out its 1 s budget
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert body["error"]["code"] == "shed" and body["error"]["type"] == "rate_limit_error"
            leaver = asyncio.create_task(_chat(session, gateway.url, "interactive"))
            await _until(session, gateway.url, lambda s: _depth(s, "interactive") == 2, "two interactive waiting")
            leaver.cancel()
            samples = await _until(session, gateway.url, lambda s: _depth(s, "interactive") == 1, "the leaver gone")
            assert _value(samples, "polymorph_requests_in_flight", pool="p") == 1  # gone from the queue, not served
            assert not interactive.done()  # still waiting after batch's deadline passed
            assert _value(samples, "polymorph_pool_queue_sheds_total", pool="p", tier="batch", reason="deadline") == 1
            await _free_the_pool(blocker, emulator)
            assert (await interactive)[0] == 200
            after = await _until(session, gateway.url, lambda s: _depth(s, "interactive") + _depth(s, "batch") == 0, "an empty queue")
            assert _value(after, "polymorph_pool_queue_wait_seconds_count", pool="p", tier="interactive") == 1  # the leaver was not served
            assert _value(after, "polymorph_rejections_total", tenant="q", reason="shed") == 1

    with _deployment(tmp_path, batch_ttft_s=2.0) as (gateway, emulator):
        asyncio.run(scenario(gateway, emulator))
    assert _served_tiers(gateway) == ["interactive"]
