"""Overload and connection pressure: 3x over capacity, and thousands of idle streams on one gateway.

Overload: two replicas run at most 4 requests each and the tenant may hold 8 in flight, so the
gateway's own admission is the only place excess can go. Offered 3x what the fleet completes, the
excess must be shed at once (429/503 with Retry-After, not queued until a timeout), admitted requests
keep their latency, memory stays flat, and latency is back to normal as soon as the load drops.

Tier-aware overload: the same two replicas, a tenant without a concurrency cap, and 3x capacity
of mixed traffic (``interactive`` half the capacity, ``batch`` the rest): the router alone must
shed. ``batch`` is refused at once with 429 + Retry-After while every pool is full, and
``interactive`` keeps its latency, because it is never queued behind the excess.

Idle streams: replicas stall every stream after its first token, so N streams stay open and silent;
a separate pool serves probe requests, whose latency must not change while the N streams are held.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from dataclasses import dataclass

import orjson

from loadtest.chaos.load import (
    OK,
    Answer,
    ChaosClient,
    Request,
    chat_request,
    closed_loop,
    open_loop,
    percentile,
)
from loadtest.chaos.report import Check, ScenarioResult, summarize
from loadtest.chaos.stack import ChaosStack, PoolPlan, StackPlan, TenantPlan

MODEL, PROBE_MODEL = "Llama-3.1-8B", "Qwen3-8B"
OVERLOAD_KEY, IDLE_KEY, TIERED_KEY = "sk-chaos-overload", "sk-chaos-idle", "sk-chaos-tiered"
_CAP = 8  # tenant concurrency = what the two replicas run at once


def overload_plan() -> StackPlan:
    return StackPlan(
        pools=(PoolPlan("main", MODEL, 2, engine={"max_running_requests": _CAP // 2}, speed=5.0),),
        tenants=(TenantPlan("capped", OVERLOAD_KEY, {"max_concurrency": _CAP, "rate_limits": {"requests_per_min": 1e8, "tokens_per_min": 1e12}}),),
        upstream={"first_byte_timeout_s": 10.0, "response_timeout_s": 10.0, "between_chunks_timeout_s": 5.0, "health_interval_s": 0.5},
    )


def tier_overload_plan() -> StackPlan:
    tenant = {"max_concurrency": 10**6, "tiers": ["interactive", "batch"], "default_tier": "interactive",
              "rate_limits": {"requests_per_min": 1e8, "tokens_per_min": 1e12}}
    return StackPlan(
        pools=(PoolPlan("main", MODEL, 2, engine={"max_running_requests": _CAP // 2}, speed=5.0),),
        tenants=(TenantPlan("tiered", TIERED_KEY, tenant),),
        upstream={"first_byte_timeout_s": 30.0, "response_timeout_s": 30.0, "between_chunks_timeout_s": 10.0, "health_interval_s": 0.5},
    )


def idle_plan() -> StackPlan:
    return StackPlan(
        pools=(PoolPlan("idle", MODEL, 2), PoolPlan("probe", PROBE_MODEL, 1, shapes=())),
        tenants=(TenantPlan("idle", IDLE_KEY, {"max_concurrency": 10**7, "rate_limits": {"requests_per_min": 1e12, "tokens_per_min": 1e15}}),),
        upstream={"first_byte_timeout_s": 60.0, "response_timeout_s": 60.0, "between_chunks_timeout_s": 600.0, "health_interval_s": 1.0},
    )


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        with contextlib.suppress(ValueError, OSError):  # only root may raise the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return max(soft, target)


def _overload_request(i: int):  # type: ignore[no-untyped-def]
    return chat_request(MODEL, OVERLOAD_KEY, max_tokens=48, stream=i % 2 == 0)


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    overload_s: float = 30.0
    factor: float = 3.0
    recovery_s: float = 3.0


async def _sample_rss(stack: ChaosStack, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(stack.gateway_rss_mb())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def overload(stack: ChaosStack, settings: OverloadSettings) -> ScenarioResult:
    async with ChaosClient(stack.url, 30.0) as client:
        warm = await closed_loop(client, _overload_request, _CAP, _CAP * 4)
        measured_s = max(a.sent_at + a.latency_s for a in warm)
        capacity_rps = len(warm) / measured_s
        base = [a.latency_s for a in warm if a.verdict == OK]
        baseline_s = percentile(base, 0.5)
        rss_before = stack.gateway_rss_mb()
        samples: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(stack, samples, stop))
        answers = await open_loop(client, _overload_request, capacity_rps * settings.factor, settings.overload_s)
        stop.set()
        await sampler
        recovery = await open_loop(client, _overload_request, capacity_rps * 0.5, settings.recovery_s)
    shed = [a for a in answers if a.status in (429, 503)]
    admitted = [a.latency_s for a in answers if a.verdict == OK]
    first_second = [a.latency_s for a in recovery if a.verdict == OK and a.sent_at < 1.0]
    rss_growth = max(samples, default=rss_before) - rss_before
    shed_p99 = percentile([a.latency_s for a in shed], 0.99)
    checks = [
        Check("excess is shed", len(shed) > len(answers) * 0.3, f"only {len(shed)} of {len(answers)} shed"),
        Check("shed answers carry Retry-After", all(a.retry_after for a in shed), "some 429/503 lacked Retry-After"),
        Check("shedding is immediate (p99 < 100 ms)", shed_p99 < 0.1, f"p99 {shed_p99 * 1000:.0f} ms"),
        Check("admitted p99 < 3x baseline p50 + 100 ms", percentile(admitted, 0.99) < 3 * baseline_s + 0.1,
              f"p99 {percentile(admitted, 0.99) * 1000:.0f} ms vs baseline {baseline_s * 1000:.0f} ms"),
        Check("memory bounded (+64 MiB)", rss_growth < 64, f"+{rss_growth:.0f} MiB"),
        Check("recovered within 1 s", bool(first_second) and percentile(first_second, 0.5) < 2 * baseline_s + 0.05,
              f"p50 {percentile(first_second, 0.5) * 1000:.0f} ms in the first second after"),
        Check("recovery load all served", all(a.verdict == OK for a in recovery),
              f"{sum(a.verdict != OK for a in recovery)} of {len(recovery)} not served"),
    ]
    figures = {
        "capacity_rps": capacity_rps, "offered_rps": capacity_rps * settings.factor, "shed": float(len(shed)),
        "shed_p99_ms": shed_p99 * 1000, "admitted_p50_ms": percentile(admitted, 0.5) * 1000,
        "admitted_p99_ms": percentile(admitted, 0.99) * 1000, "baseline_p50_ms": baseline_s * 1000,
        "rss_before_mb": rss_before, "rss_growth_mb": rss_growth,
        "recovery_p50_ms": percentile(first_second, 0.5) * 1000,
    }
    return summarize("overload-3x", [*answers, *recovery], 0, baseline_s, checks, figures)


def _tiered_request(tier: str) -> Request:
    return chat_request(MODEL, TIERED_KEY, max_tokens=64, stream=False, extra_headers={"x-polymorph-tier": tier})


def _mixed_tiers(interactive_share: float):  # type: ignore[no-untyped-def]
    """Request i is interactive for ``interactive_share`` of the indices, spread evenly; batch otherwise."""
    return lambda i: _tiered_request("interactive" if _is_interactive(i, interactive_share) else "batch")


async def tier_overload(stack: ChaosStack, settings: OverloadSettings, interactive_ttft_s: float = 1.0) -> ScenarioResult:
    """3x capacity, ``interactive`` at half the capacity and ``batch`` the rest; then half the capacity again."""
    async with ChaosClient(stack.url, 60.0) as client:
        warm = await closed_loop(client, lambda i: _tiered_request("interactive"), _CAP, _CAP * 4)
        capacity_rps = len(warm) / max(a.sent_at + a.latency_s for a in warm)
        base = [a.latency_s for a in warm if a.verdict == OK]
        baseline_p50, baseline_p99 = percentile(base, 0.5), percentile(base, 0.99)
        rss_before = stack.gateway_rss_mb()
        samples: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(stack, samples, stop))
        offered = capacity_rps * settings.factor
        share = 0.5 * capacity_rps / offered
        answers = await open_loop(client, _mixed_tiers(share), offered, settings.overload_s)
        stop.set()
        await sampler
        recovery = await open_loop(client, _mixed_tiers(0.5), capacity_rps * 0.5, settings.recovery_s)
    interactive = [a for i, a in enumerate(answers) if _is_interactive(i, share)]
    batch = [a for i, a in enumerate(answers) if not _is_interactive(i, share)]
    shed = [a for a in batch if a.status in (429, 503)]
    inter_ok = [a.latency_s for a in interactive if a.verdict == OK]
    inter_p99 = percentile(inter_ok, 0.99)
    shed_p99 = percentile([a.latency_s for a in shed], 0.99)
    first_second = [a.latency_s for a in recovery if a.verdict == OK and a.sent_at < 1.0]
    rss_growth = max(samples, default=rss_before) - rss_before
    checks = [
        Check("every interactive request served", len(inter_ok) == len(interactive),
              f"{len(interactive) - len(inter_ok)} of {len(interactive)} not served: {sorted({a.status for a in interactive if a.verdict != OK})}"),
        Check("interactive within its TTFT objective of the baseline", inter_p99 < baseline_p99 + interactive_ttft_s,
              f"p99 {inter_p99 * 1000:.0f} ms vs baseline p99 {baseline_p99 * 1000:.0f} ms + {interactive_ttft_s:g} s"),
        Check("batch is shed", len(shed) > len(batch) * 0.3, f"only {len(shed)} of {len(batch)} batch requests shed"),
        Check("shed batch gets 429 with Retry-After", all(a.status == 429 and a.retry_after for a in shed),
              f"statuses {sorted({a.status for a in shed})}"),
        Check("shedding is immediate (p99 < 100 ms)", shed_p99 < 0.1, f"p99 {shed_p99 * 1000:.0f} ms"),
        Check("memory bounded (+64 MiB)", rss_growth < 64, f"+{rss_growth:.0f} MiB"),
        Check("recovered within 1 s", bool(first_second) and percentile(first_second, 0.5) < 2 * baseline_p50 + 0.05,
              f"p50 {percentile(first_second, 0.5) * 1000:.0f} ms in the first second after"),
        Check("recovery load all served", all(a.verdict == OK for a in recovery),
              f"{sum(a.verdict != OK for a in recovery)} of {len(recovery)} not served"),
    ]
    figures = {
        "capacity_rps": capacity_rps, "offered_rps": offered, "batch_shed": float(len(shed)), "shed_p99_ms": shed_p99 * 1000,
        "interactive_p50_ms": percentile(inter_ok, 0.5) * 1000, "interactive_p99_ms": inter_p99 * 1000,
        "baseline_p50_ms": baseline_p50 * 1000, "baseline_p99_ms": baseline_p99 * 1000, "rss_growth_mb": rss_growth,
        "recovery_p50_ms": percentile(first_second, 0.5) * 1000,
    }
    return summarize("tier-overload-3x", [*answers, *recovery], 0, baseline_p50, checks, figures)


def _is_interactive(i: int, share: float) -> bool:
    return int((i + 1) * share) > int(i * share)


# --- idle streams ----------------------------------------------------------------------------------


async def _hold_stream(port: int, request: bytes, held: list[asyncio.StreamWriter], opened: asyncio.Semaphore) -> str | None:
    """Open one stream and keep it; returns why it failed, or None once its first event arrived."""
    async with opened:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            return f"connect failed: {exc.strerror or exc}"
        held.append(writer)
        writer.write(request)
        try:
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"data:")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            return f"no first event: {type(exc).__name__}"
    return None if head.startswith(b"HTTP/1.1 200") else f"answered {head[:12]!r}"


def _raw_stream_request(model: str, max_tokens: int) -> bytes:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hold this stream"}],
                         "max_tokens": max_tokens, "stream": True})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {IDLE_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


async def _probe(client: ChaosClient, num: int) -> list[Answer]:
    return await closed_loop(client, lambda i: chat_request(PROBE_MODEL, IDLE_KEY, 64, stream=True), 1, num)


async def idle_streams(stack: ChaosStack, num_streams: int, num_slow_readers: int = 20) -> ScenarioResult:
    """``num_streams`` open silent streams plus readers that never read; probes must not notice."""
    for index in range(2):
        await asyncio.to_thread(stack.set_faults, "idle", index, stall_after_tokens=1, stall_s=-1)
    port = stack.gateway_port
    held: list[asyncio.StreamWriter] = []
    loop = asyncio.get_running_loop()
    try:
        async with ChaosClient(stack.url, 30.0) as client:
            before = await _probe(client, 10)
            rss_before = stack.gateway_rss_mb()
            opened_at = loop.time()
            gate = asyncio.Semaphore(512)
            request = _raw_stream_request(MODEL, 8)
            failures = await asyncio.gather(*(_hold_stream(port, request, held, gate) for _ in range(num_streams)))
            open_s = loop.time() - opened_at
            slow = [_raw_stream_request(PROBE_MODEL, 4000) for _ in range(num_slow_readers)]
            for raw in slow:  # readers that never read: their streams back up into the gateway
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(raw)
                held.append(writer)
            await asyncio.sleep(1.0)
            rss_open = stack.gateway_rss_mb()
            during = await _probe(client, 10)
            alive = stack.gateway_alive()
    finally:
        for writer in held:
            writer.close()
        stack.reset_faults()
    lost = [f for f in failures if f is not None]
    p50_before = percentile([a.latency_s for a in before], 0.5)
    p50_during = percentile([a.latency_s for a in during], 0.5)
    per_stream_kb = (rss_open - rss_before) * 1024 / max(1, num_streams)
    checks = [
        Check("gateway alive", alive, "the gateway process died"),
        Check("every stream opened", not lost, f"{len(lost)} failed: {sorted(set(lost))[:3]}"),
        Check("probes unaffected (p50 < 2x + 50 ms)", p50_during < 2 * p50_before + 0.05,
              f"{p50_during * 1000:.0f} ms vs {p50_before * 1000:.0f} ms"),
        Check("probes all served", all(a.verdict == OK for a in (*before, *during)), "a probe failed"),
        Check("memory bounded (< 64 KiB a stream)", per_stream_kb < 64, f"{per_stream_kb:.1f} KiB a stream"),
    ]
    figures = {
        "streams": float(num_streams), "open_s": open_s, "rss_before_mb": rss_before, "rss_open_mb": rss_open,
        "kib_per_stream": per_stream_kb, "probe_p50_before_ms": p50_before * 1000, "probe_p50_during_ms": p50_during * 1000,
    }
    return ScenarioResult(
        name="idle-streams", sent=num_streams + len(before) + len(during),
        succeeded=num_streams - len(lost) + sum(a.verdict == OK for a in (*before, *during)), retried=0,
        failed_clear=0, lost=len(lost), max_added_latency_ms=max(0.0, (p50_during - p50_before) * 1000),
        checks=tuple(checks), figures=figures, lost_reasons=tuple(lost),
    )
