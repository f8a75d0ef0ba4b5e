"""Replica faults under live load: each scenario injects one failure mid-run, heals it, and counts.

Every scenario runs open-loop load (half streaming, half not) against one shared deployment: pool
``chat`` (two replicas, every shape), pool ``spare`` (one replica of the same model, no shapes: it
takes only overflow) and pool ``solo`` (the only replica of a second model). A scenario leaves the
deployment as it found it: faults cleared, every replica back and readmitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtest.chaos.load import (
    CLEAR,
    OK,
    ChaosClient,
    Request,
    chat_request,
    open_loop,
    percentile,
)
from loadtest.chaos.report import Check, ScenarioResult, summarize
from loadtest.chaos.stack import ChaosStack, PoolPlan, StackPlan, TenantPlan, wait_until

MODEL, SOLO_MODEL = "Llama-3.1-8B", "Qwen3-8B"
LOAD_KEY = "sk-chaos-load"
UPSTREAM = {
    "connect_timeout_s": 0.5,
    "first_byte_timeout_s": 1.0,
    "response_timeout_s": 1.0,
    "between_chunks_timeout_s": 1.0,
    "max_attempts": 3,
    "retry_budget_ratio": 0.5,
    "eject_after_failures": 2,
    "eject_cooldown_s": 1.0,
    "health_interval_s": 0.2,
}
# The longest a correct answer can take: every attempt timing out before its first byte, then a stall.
DEADLINE_S = UPSTREAM["max_attempts"] * (UPSTREAM["connect_timeout_s"] + max(UPSTREAM["first_byte_timeout_s"], UPSTREAM["response_timeout_s"])) + 3.0
# A restarted replica is readmitted within a second here; a process start beside the test suite's first,
# busiest minute once took over 15 s (the figure reports the actual time either way)
READMIT_TIMEOUT_S = 45.0
RELOADS = "polymorph_config_reloads_total"
RELOAD_SEEN_TIMEOUT_S = 15.0  # a reload is seen within a poll (1 s) on a quiet machine
RELOAD_MAX_S = 4 * RELOAD_SEEN_TIMEOUT_S  # the load runs until the restored files serve, at most this long


def fault_plan() -> StackPlan:
    return StackPlan(
        pools=(
            PoolPlan("chat", MODEL, 2),
            PoolPlan("spare", MODEL, 1, shapes=()),
            PoolPlan("solo", SOLO_MODEL, 1, shapes=()),
        ),
        tenants=(TenantPlan("load", LOAD_KEY, {"max_concurrency": 100000, "rate_limits": {"requests_per_min": 1e8, "tokens_per_min": 1e12}}),),
        upstream=UPSTREAM,
    )


@dataclass(frozen=True, slots=True)
class FaultSettings:
    rate_rps: float = 80.0
    duration_s: float = 3.0
    reload_rate_rps: float = 300.0


def mixed_request(i: int, model: str = MODEL) -> Request:
    return chat_request(model, LOAD_KEY, max_tokens=12, stream=i % 2 == 0)


class FaultRunner:
    """Runs fault scenarios one after another against one deployment."""

    def __init__(self, stack: ChaosStack, settings: FaultSettings) -> None:
        self.stack = stack
        self.settings = settings
        self.baseline_s = 0.0

    async def _load_with(self, name: str, inject: Callable[[], None], heal: Callable[[], None],
                         make: Callable[[int], Request] = mixed_request, rate_rps: float | None = None) -> tuple[list, float]:
        """Load for ``duration_s``; ``inject`` at 20 %, ``heal`` at 70 %. Returns (answers, retries)."""
        stack, s = self.stack, self.settings
        retries_before = stack.metric("polymorph_upstream_retries_total")
        async with ChaosClient(stack.url, DEADLINE_S) as client:
            load = asyncio.create_task(open_loop(client, make, rate_rps or s.rate_rps, s.duration_s))
            await asyncio.sleep(s.duration_s * 0.2)
            await asyncio.to_thread(inject)
            await asyncio.sleep(s.duration_s * 0.5)
            await asyncio.to_thread(heal)
            answers = await load
        return answers, stack.metric("polymorph_upstream_retries_total") - retries_before

    async def _readmitted(self, pool: str, indices: tuple[int, ...]) -> tuple[list[Check], dict[str, float]]:
        checks, figures = [], {}
        for index in indices:
            after_s = await asyncio.to_thread(self.stack.wait_readmitted, pool, index, READMIT_TIMEOUT_S)
            checks.append(Check(f"{pool}-{index} readmitted", after_s is not None, f"not healthy after {READMIT_TIMEOUT_S:g} s"))
            figures[f"{pool}_{index}_readmitted_after_s"] = after_s if after_s is not None else -1.0
        return checks, figures

    async def baseline(self) -> ScenarioResult:
        answers, retried = await self._load_with("baseline", lambda: None, lambda: None)
        ok = [a.latency_s for a in answers if a.verdict == OK]
        self.baseline_s = percentile(ok, 0.5)
        checks = [Check("all succeed", len(ok) == len(answers), f"{len(answers) - len(ok)} did not")]
        return summarize("baseline", answers, retried, self.baseline_s, checks,
                         {"p50_ms": self.baseline_s * 1000, "p99_ms": percentile(ok, 0.99) * 1000})

    async def replica_fault(self, name: str, **faults: object) -> ScenarioResult:
        """One replica of ``chat`` misbehaves; requests not yet answered must be retried elsewhere."""
        stack = self.stack
        answers, retried = await self._load_with(
            name, lambda: stack.set_faults("chat", 0, **faults), lambda: stack.set_faults("chat", 0, reset=True))
        checks, figures = await self._readmitted("chat", (0,))
        non_stream_failed = [a for a in answers if a.verdict != OK and a.status != 200]
        checks.append(Check("nothing failed before its first byte", not non_stream_failed,
                            f"{len(non_stream_failed)} got {sorted({a.status for a in non_stream_failed})}"))
        clear_streams = [a for a in answers if a.verdict == CLEAR and a.status == 200]
        figures["streams_ended_with_sse_error"] = float(len(clear_streams))
        return summarize(name, answers, retried, self.baseline_s, checks, figures)

    async def crash_exit_restart(self) -> ScenarioResult:
        """A stream's replica exits mid-stream (its process dies), and is restarted on its port."""
        stack = self.stack
        answers, retried = await self._load_with(
            "crash-exit-restart",
            lambda: stack.set_faults("chat", 0, crash_after_tokens=3, crash_mode="exit"),
            lambda: stack.restart_replica("chat", 0))
        checks, figures = await self._readmitted("chat", (0,))
        return summarize("crash-exit-restart", answers, retried, self.baseline_s, checks, figures)

    async def replica_killed(self) -> ScenarioResult:
        stack = self.stack
        answers, retried = await self._load_with(
            "replica-killed", lambda: stack.kill_replica("chat", 1), lambda: stack.restart_replica("chat", 1))
        checks, figures = await self._readmitted("chat", (1,))
        return summarize("replica-killed", answers, retried, self.baseline_s, checks, figures)

    async def pool_overflow(self) -> ScenarioResult:
        """Every replica of the shape's own pool dies: its traffic overflows to the spare pool of the same model."""
        stack = self.stack

        def kill() -> None:
            stack.kill_replica("chat", 0)
            stack.kill_replica("chat", 1)

        def restart() -> None:
            stack.restart_replica("chat", 0)
            stack.restart_replica("chat", 1)

        answers, retried = await self._load_with("pool-overflow", kill, restart)
        checks, figures = await self._readmitted("chat", (0, 1))
        num_spare = sum(a.verdict == OK and a.detail == "spare" for a in answers)
        checks.append(Check("overflow served by pool spare", num_spare > 0, "no request reached the spare pool"))
        figures["served_by_spare"] = float(num_spare)
        return summarize("pool-overflow", answers, retried, self.baseline_s, checks, figures)

    async def pool_down(self) -> ScenarioResult:
        """The only pool of a model is down: every request gets a quick 5xx envelope with Retry-After."""
        stack = self.stack
        answers, retried = await self._load_with(
            "pool-down", lambda: stack.kill_replica("solo", 0), lambda: None,
            make=lambda i: mixed_request(i, SOLO_MODEL), rate_rps=self.settings.rate_rps / 2)
        await asyncio.to_thread(stack.restart_replica, "solo", 0)
        checks, figures = await self._readmitted("solo", (0,))
        down = [a for a in answers if a.verdict != OK]
        refused = [a for a in down if a.status == 503]
        checks += [
            Check("every failure is 502/503 with Retry-After", all(a.status in (502, 503) and a.retry_after for a in down),
                  f"statuses {sorted({a.status for a in down})}"),
            Check("ejected pool answers 503 no_healthy_replica", bool(refused) and all(a.detail == "no_healthy_replica" for a in refused),
                  f"{len(refused)} 503s"),
            Check("refusals are quick (p99 < 100 ms)", percentile([a.latency_s for a in refused], 0.99) < 0.1,
                  f"p99 {percentile([a.latency_s for a in refused], 0.99) * 1000:.0f} ms"),
        ]
        figures["refused_p99_ms"] = percentile([a.latency_s for a in refused], 0.99) * 1000
        return summarize("pool-down", answers, retried, self.baseline_s, checks, figures)

    async def invalid_reload(self) -> ScenarioResult:
        """Tenant file, then config file, replaced by invalid ones under load: rejected, zero failed requests.

        Each step waits for the gateway's reload counter instead of a fixed sleep: its watcher polls
        every second, and on a loaded machine a poll can come late enough to miss a 1.6 s window."""
        stack = self.stack
        tenant_file = stack.tenants_dir / "load.yaml"
        good_tenant, good_config = tenant_file.read_text(), stack.config_path.read_text()
        rejected_before = stack.metric(RELOADS, 'result="rejected"')
        applied_before = stack.metric(RELOADS, 'result="applied"')
        version_before = stack.admin_state()["config"]["version"]
        s = self.settings
        async with ChaosClient(stack.url, DEADLINE_S) as client:
            restored = asyncio.Event()
            load = asyncio.create_task(open_loop(client, mixed_request, s.reload_rate_rps, RELOAD_MAX_S, until=restored))
            await asyncio.sleep(s.duration_s / 2)
            self._replace(tenant_file, "name: load\napi_key_sha256: [not-a-hash]\n")
            await asyncio.to_thread(_reloads_reach, stack, 'result="rejected"', rejected_before + 1)
            self._replace(tenant_file, good_tenant)
            self._replace(stack.config_path, "fleet: [unclosed\n")
            await asyncio.to_thread(_reloads_reach, stack, 'result="rejected"', rejected_before + 2)
            version_during = (await asyncio.to_thread(stack.admin_state))["config"]["version"]
            applied_during = await asyncio.to_thread(stack.metric, RELOADS, 'result="applied"')
            self._replace(stack.config_path, good_config)
            await asyncio.to_thread(_reloads_reach, stack, 'result="applied"', applied_during + 1)
            await asyncio.sleep(s.duration_s / 2)  # the restored version serves under load too
            restored.set()
            answers = await load
        rejected = stack.metric(RELOADS, 'result="rejected"') - rejected_before
        applied = stack.metric(RELOADS, 'result="applied"') - applied_before
        failed = [a for a in answers if a.verdict != OK]
        checks = [
            Check("zero failed requests", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
            Check("both invalid versions rejected", rejected >= 2, f"{rejected:g} rejections"),
            Check("old version kept serving", version_during == version_before, f"{version_before} -> {version_during}"),
            Check("restored files applied", applied >= 1, f"{applied:g} applied"),
        ]
        ok = [a.latency_s for a in answers if a.verdict == OK]
        return summarize("invalid-reload", answers, 0, self.baseline_s, checks,
                         {"rate_rps": s.reload_rate_rps, "rejected": rejected, "p99_ms": percentile(ok, 0.99) * 1000})

    def _replace(self, path: Path, text: str) -> None:
        """Swap the file whole (as an operator's tool or a ConfigMap does): a poll never reads half of it."""
        staged = self.stack.config_path.parent / f".{path.name}.staged"
        staged.write_text(text)
        os.replace(staged, path)


def _reloads_reach(stack: ChaosStack, labels: str, target: float) -> None:
    """Wait until the reload counter with ``labels`` reaches ``target``; after ``RELOAD_SEEN_TIMEOUT_S``
    go on (the scenario's checks then say what did not happen)."""
    with contextlib.suppress(TimeoutError):
        wait_until(f"{RELOADS}{{{labels}}} >= {target:g}", lambda: stack.metric(RELOADS, labels) >= target, RELOAD_SEEN_TIMEOUT_S)


FAULT_SCENARIOS: dict[str, Callable[[FaultRunner], object]] = {
    "baseline": FaultRunner.baseline,
    "refuse-connections": lambda r: r.replica_fault("refuse-connections", refuse_connections_s=1.5),
    "http-5xx": lambda r: r.replica_fault("http-5xx", error_rate=1.0, error_status=503),
    "hang-before-first-byte": lambda r: r.replica_fault("hang-before-first-byte", hang_before_first_byte_s=30.0),
    "stall-mid-stream": lambda r: r.replica_fault("stall-mid-stream", stall_after_tokens=3, stall_s=30.0),
    "crash-mid-stream": lambda r: r.replica_fault("crash-mid-stream", crash_after_tokens=3, crash_mode="cut"),
    "crash-exit-restart": FaultRunner.crash_exit_restart,
    "replica-killed": FaultRunner.replica_killed,
    "pool-overflow": FaultRunner.pool_overflow,
    "pool-down": FaultRunner.pool_down,
    "invalid-reload": FaultRunner.invalid_reload,
}
