"""The live runner: replays a ``Workload`` against an OpenAI-compatible endpoint over one aiohttp session.

Open loop (default): each request goes out at its scheduled instant whatever the responses do.
The scheduler prepares the next request's body while it waits, sleeps until the arrival, then
starts its task; the send instant minus the scheduled one is the scheduling error every record
carries. Closed loop: a fixed number of workers each send their next request as soon as the last
one finishes. This module is the async I/O edge; workloads and summaries stay pure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kernels.tiers import DEFAULT_TIERS, TierSlo
from loadtest.client import PreparedRequest, prepare, send
from loadtest.events import fetch_gateway_events
from loadtest.progress import Progress
from loadtest.prompts import PromptSource
from loadtest.record import RequestRecord
from loadtest.spec import RequestSpec, Workload

_PROGRESS_INTERVAL_S = 0.5
_BYTES_PER_TOKEN = 5  # prompt text plus JSON, roughly
_MAX_PREPARED_BYTES = 512 * 2**20
_EARLY_WAKE_S = 0.002


class TargetUnreachable(RuntimeError):
    """The target did not answer at all (connection refused, DNS, timeout)."""


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    target_url: str  # base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    tenant_to_api_key: Mapping[str, str] = field(default_factory=dict)
    stream: bool = True
    concurrency: int | None = None  # closed loop with this many workers; None = open loop
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 120.0  # after the last send, wait this long for responses
    admin_token: str | None = None  # for GET /admin/decisions
    progress: bool = True

    @property
    def base_url(self) -> str:
        url = self.target_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def key_for(self, tenant: str) -> str | None:
        return self.tenant_to_api_key.get(tenant, self.api_key)


@dataclass(frozen=True, slots=True)
class RunResult:
    records: tuple[RequestRecord, ...]
    model: str
    mode: str
    duration_s: float  # run start to last response
    started_at_unix_s: float
    gateway_events: tuple[dict[str, Any], ...]


def run(
    workload: Workload,
    config: RunnerConfig,
    tier_to_slo: Mapping[str, TierSlo] = DEFAULT_TIERS,
    prompts: PromptSource | None = None,
) -> RunResult:
    """Run on a fresh uvloop event loop (the CLI entry point)."""
    import uvloop

    return uvloop.run(run_async(workload, config, tier_to_slo, prompts))


async def run_async(
    workload: Workload,
    config: RunnerConfig,
    tier_to_slo: Mapping[str, TierSlo] = DEFAULT_TIERS,
    prompts: PromptSource | None = None,
) -> RunResult:
    prompts = prompts or PromptSource()
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=10.0)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await _discover_model(session, config)
        loop = asyncio.get_running_loop()
        _warm_up(workload, prompts)
        clock = _RunClock()
        progress = Progress(workload.num_requests, tier_to_slo, config.progress)
        dispatch = _Dispatch(session, config, model, prompts, clock, progress, workload)
        started_at_unix_s = time.time()
        clock.restart()
        ticker = loop.create_task(_tick(progress, clock))
        try:
            if config.concurrency:
                await _closed_loop(workload, dispatch, config.concurrency)
            else:
                await _open_loop(workload, dispatch, clock)
            await dispatch.drain(config.drain_timeout_s)
        finally:
            ticker.cancel()
            progress.refresh(clock())
            progress.close()
        duration_s = max(dispatch.finished_at_s, default=clock())
        events = await fetch_gateway_events(session, config.base_url, config.admin_token, started_at_unix_s)
    mode = "closed-loop" if config.concurrency else "open-loop"
    records = tuple(sorted(dispatch.records, key=lambda record: record.index))
    return RunResult(records, model, mode, duration_s, started_at_unix_s, events)


class _RunClock:
    """Seconds since the run started. perf_counter, because uvloop's own clock ticks in whole milliseconds."""

    __slots__ = ("_start_s",)

    def __init__(self) -> None:
        self._start_s = time.perf_counter()

    def restart(self) -> None:
        self._start_s = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._start_s


def _warm_up(workload: Workload, prompts: PromptSource) -> None:
    """Load each domain's corpus and the token weights before the clock starts, not on the first send."""
    for domain in sorted({spec.domain for spec in workload.specs}):
        prompts.text_for(RequestSpec(0.0, 64, 1, domain=domain), key=0)


async def _discover_model(session: aiohttp.ClientSession, config: RunnerConfig) -> str:
    """Probe the target (GET /v1/models) and take its first model unless one was given."""
    url = f"{config.base_url}/v1/models"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=15)) as response:
            status = response.status
            listing = await response.json(content_type=None) if status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise TargetUnreachable(f"cannot reach the target {config.base_url}: {type(exc).__name__}: {exc}") from None
    except ValueError:
        listing = None
    if config.model:
        return config.model
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise TargetUnreachable(
            f"GET {url} answered {status} without a model list; pass --model (and --api-key if the target needs one)"
        )
    return str(models[0]["id"])


async def _tick(progress: Progress, clock: Callable[[], float]) -> None:
    while True:
        await asyncio.sleep(_PROGRESS_INTERVAL_S)
        progress.refresh(clock())


class _Dispatch:
    """Prepares requests, starts their tasks and collects the records."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        config: RunnerConfig,
        model: str,
        prompts: PromptSource,
        clock: Callable[[], float],
        progress: Progress,
        workload: Workload,
    ) -> None:
        self._session = session
        self._config = config
        self._url = f"{config.base_url}/v1/chat/completions"
        self._model = model
        self._prompts = prompts
        self._clock = clock
        self._progress = progress
        self._index_to_task: dict[int, tuple[asyncio.Task[None], PreparedRequest, float]] = {}
        self.records: list[RequestRecord] = []
        self.finished_at_s: list[float] = []
        self._workload = workload
        # Bodies built before the clock starts cost the schedule nothing; past a memory budget,
        # they are built while the scheduler waits for each arrival instead.
        num_prompt_bytes = _BYTES_PER_TOKEN * sum(spec.input_tokens for spec in workload.specs)
        self._prepared = [self._build(i) for i in range(workload.num_requests)] if num_prompt_bytes <= _MAX_PREPARED_BYTES else None

    def _build(self, index: int) -> PreparedRequest:
        spec = self._workload.specs[index]
        text = self._prompts.text_for(spec, key=index)
        return prepare(index, spec, text, self._model, self._config.stream, self._config.key_for(spec.tenant))

    def prepare(self, index: int) -> PreparedRequest:
        return self._prepared[index] if self._prepared is not None else self._build(index)

    def start(self, request: PreparedRequest, scheduled_at_s: float) -> None:
        task = asyncio.get_running_loop().create_task(self.send(request, scheduled_at_s))
        self._index_to_task[request.index] = (task, request, scheduled_at_s)
        task.add_done_callback(lambda _: self._index_to_task.pop(request.index, None))

    async def send(self, request: PreparedRequest, scheduled_at_s: float | None = None) -> None:
        """Send now; ``scheduled_at_s`` None means "as soon as possible" (closed loop: no lag)."""
        self._progress.on_sent()
        scheduled = self._clock() if scheduled_at_s is None else scheduled_at_s
        record = await send(self._session, self._url, request, scheduled, self._clock)
        self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        now_s = self._clock()
        self.records.append(record)
        self.finished_at_s.append(now_s)
        self._progress.on_done(record, now_s)

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight requests; those still running after ``timeout_s`` are cancelled and recorded."""
        pending = [task for task, _, _ in self._index_to_task.values()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        leftovers = list(self._index_to_task.values())
        for task, request, scheduled_at_s in leftovers:
            task.cancel()
            self._finish(_unfinished(request, scheduled_at_s, self._config.stream))
        await asyncio.gather(*(task for task, _, _ in leftovers), return_exceptions=True)


def _unfinished(request: PreparedRequest, scheduled_at_s: float, stream: bool) -> RequestRecord:
    spec = request.spec
    return RequestRecord(
        index=request.index, scheduled_at_s=scheduled_at_s, sent_at_s=scheduled_at_s, ttft_s=None, itl_s=(),
        tpot_s=None, e2e_s=None, input_tokens=spec.input_tokens, output_tokens=0,
        target_input_tokens=spec.input_tokens, target_output_tokens=spec.output_tokens, status=0,
        error="unfinished: no response within the drain timeout", tenant=spec.tenant, tier=spec.tier,
        domain=spec.domain, label=spec.label, stream=stream,
    )


async def _open_loop(workload: Workload, dispatch: _Dispatch, clock: Callable[[], float]) -> None:
    """Sleep until each arrival, then start its request; catch up without sleeping when behind."""
    for index, spec in enumerate(workload.specs):
        request = dispatch.prepare(index)
        # The loop's timers tick in whole milliseconds and a sleeping process waits for the OS to
        # run it again: wake a little early, then yield to the loop until the instant arrives.
        while (delay_s := spec.arrival_s - clock()) > 0:
            await asyncio.sleep(delay_s - _EARLY_WAKE_S if delay_s > _EARLY_WAKE_S else 0)
        dispatch.start(request, spec.arrival_s)


async def _closed_loop(workload: Workload, dispatch: _Dispatch, concurrency: int) -> None:
    indices: Iterator[int] = iter(range(workload.num_requests))

    async def worker() -> None:
        for index in indices:
            await dispatch.send(dispatch.prepare(index))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
