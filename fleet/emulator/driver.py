"""The wall clock around the engine: one asyncio task per data-parallel rank runs
``plan = schedule(now); sleep(plan.duration_s / speed); update(plan, now)`` and hands each
request's new tokens to the HTTP handler waiting on its ``TokenStream``.

Iterations are laid end to end on a deadline timeline, so the loop's own processing time and the
timer's millisecond granularity do not add up: a late wake-up shortens the next sleep. Only when
the loop falls behind by more than ``CATCH_UP_S`` does the timeline restart from now; that lost
time is the drift ``TimingStats`` reports (the ``polymorph bench emulator`` figure).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from fleet.emulator.metrics import Histogram
from kernels.engine import Engine
from kernels.engine_types import EngineRequest, EngineStats, StepOutputs

CATCH_UP_S = 0.025  # how far behind the timeline the loop may fall and still catch up
_TTFT_BUCKETS_S = (0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 120.0, 160.0)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
_NUM_LATENESS_SAMPLES = 20_000


class TokenStream:
    """The tokens the engine has produced for one request, read by its HTTP handler."""

    __slots__ = ("req_id", "num_ready", "num_cached_tokens", "is_finished", "submitted_at", "_waiter")

    def __init__(self, req_id: str, submitted_at: float) -> None:
        self.req_id = req_id
        self.num_ready = 0
        self.num_cached_tokens = 0
        self.is_finished = False
        self.submitted_at = submitted_at
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Until more tokens are ready or the request finished."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class TimingStats:
    """How faithfully wall time followed the engine's planned iteration times."""

    num_iterations: int
    planned_busy_s: float  # sum of planned iteration wall times in busy periods
    actual_busy_s: float  # wall time those busy periods took
    p50_late_ms: float  # how late iterations ended vs their deadline
    p99_late_ms: float
    max_late_ms: float

    @property
    def drift(self) -> float:
        return self.actual_busy_s / self.planned_busy_s - 1.0 if self.planned_busy_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "num_iterations": self.num_iterations,
            "planned_busy_s": round(self.planned_busy_s, 6),
            "actual_busy_s": round(self.actual_busy_s, 6),
            "drift": round(self.drift, 6),
            "p50_late_ms": round(self.p50_late_ms, 3),
            "p99_late_ms": round(self.p99_late_ms, 3),
            "max_late_ms": round(self.max_late_ms, 3),
        }


class _Rank:
    """One engine (data-parallel rank) and its loop's bookkeeping."""

    __slots__ = ("engine", "wakeup", "task", "busy_since", "planned_s")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.busy_since: float | None = None
        self.planned_s = 0.0


class EngineDriver:
    """Runs engines on the wall clock (scaled by ``speed``) and feeds per-request token streams."""

    def __init__(self, engines: Sequence[Engine], speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self.slowdown = 1.0  # fault injection: iterations take this many times longer
        self._ranks = [_Rank(engine) for engine in engines]
        self._streams: dict[str, TokenStream] = {}
        self._req_id_to_rank: dict[str, _Rank] = {}
        self._next_rank = count()
        self._started_at = time.monotonic()
        self.ttft_s = Histogram(_TTFT_BUCKETS_S)
        self.e2e_s = Histogram(_E2E_BUCKETS_S)
        self.last_abort_at: float | None = None  # monotonic instant of the last abort
        self._num_iterations = 0
        self._planned_busy_s = 0.0
        self._actual_busy_s = 0.0
        self._lateness_s: deque[float] = deque(maxlen=_NUM_LATENESS_SAMPLES)

    @property
    def engines(self) -> tuple[Engine, ...]:
        return tuple(rank.engine for rank in self._ranks)

    def engine_now(self) -> float:
        return self._engine_time(time.monotonic())

    def _engine_time(self, wall_at: float) -> float:
        return (wall_at - self._started_at) * self.speed

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for rank in self._ranks:
            rank.task = asyncio.get_running_loop().create_task(self._run(rank))

    async def stop(self) -> None:
        tasks = [rank.task for rank in self._ranks if rank.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- requests --------------------------------------------------------------------------------
    def submit(
        self, req_id: str, prompt_tokens: int, output_tokens: int, domain: str, prefix_hash_ids: tuple[int, ...],
        max_new_tokens: int,
    ) -> TokenStream | None:
        """Queue a request on the next rank (round robin, as sglang's DP controller); None if it can never fit."""
        rank = self._ranks[next(self._next_rank) % len(self._ranks)]
        now = self.engine_now()
        req = EngineRequest(req_id, prompt_tokens, output_tokens, domain, prefix_hash_ids, now, max_new_tokens)
        if not rank.engine.add_request(req, now):
            return None
        stream = TokenStream(req_id, time.monotonic())
        self._streams[req_id] = stream
        self._req_id_to_rank[req_id] = rank
        rank.wakeup.set()
        return stream

    def abort(self, req_id: str) -> None:
        """Drop a request (client gone); its engine frees the KV at once."""
        self._streams.pop(req_id, None)
        rank = self._req_id_to_rank.pop(req_id, None)
        if rank is not None and rank.engine.abort(req_id, self.engine_now()):
            self.last_abort_at = time.monotonic()

    # --- the clock loop --------------------------------------------------------------------------
    async def _run(self, rank: _Rank) -> None:
        engine = rank.engine
        deadline = 0.0
        while True:
            now = time.monotonic()
            if rank.busy_since is None or now - deadline > CATCH_UP_S:
                deadline = now  # idle until now, or fell too far behind: restart the timeline
            plan = engine.schedule(self._engine_time(deadline)) if engine.has_work() else None
            if plan is None:
                self._end_busy(rank)
                rank.wakeup.clear()
                await rank.wakeup.wait()
                continue
            if rank.busy_since is None:
                rank.busy_since = deadline
            wall_s = plan.duration_s * self.slowdown / self.speed
            deadline += wall_s
            rank.planned_s += wall_s
            delay = deadline - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._lateness_s.append(time.monotonic() - deadline)
            self._dispatch(engine.update(plan, self._engine_time(deadline)))
            self._num_iterations += 1

    def _end_busy(self, rank: _Rank) -> None:
        if rank.busy_since is not None:
            self._actual_busy_s += time.monotonic() - rank.busy_since
            self._planned_busy_s += rank.planned_s
            rank.busy_since = None
            rank.planned_s = 0.0

    def _dispatch(self, outputs: StepOutputs) -> None:
        streams = self._streams
        now = time.monotonic()
        for req_id, cached in zip(outputs.first_token_req_ids, outputs.first_token_num_cached, strict=True):
            stream = streams.get(req_id)
            if stream is not None:
                stream.num_cached_tokens = cached
                self.ttft_s.observe(now - stream.submitted_at)
        for req_id, num_tokens in zip(outputs.new_token_req_ids, outputs.num_new_tokens, strict=True):
            stream = streams.get(req_id)
            if stream is not None:
                stream.num_ready += num_tokens
                stream.wake()
        for req_id in outputs.finished_req_ids:
            stream = streams.pop(req_id, None)
            self._req_id_to_rank.pop(req_id, None)
            if stream is not None:
                stream.is_finished = True
                stream.wake()
                self.e2e_s.observe(now - stream.submitted_at)

    # --- views -----------------------------------------------------------------------------------
    def engine_stats(self) -> EngineStats:
        """Stats summed over ranks (rates and ratios recomputed from the sums)."""
        now = self.engine_now()
        per_rank = [rank.engine.stats(now) for rank in self._ranks]
        if len(per_rank) == 1:
            return per_rank[0]
        total = {name: sum(getattr(s, name) for s in per_rank) for name in EngineStats.__slots__}
        prompt = total["num_prompt_tokens_total"]
        total["cache_hit_rate"] = total["num_cached_tokens_total"] / prompt if prompt else 0.0
        return EngineStats(**total)

    def timing_stats(self) -> TimingStats:
        for rank in self._ranks:  # close the books on busy periods still running
            if rank.busy_since is not None:
                now = time.monotonic()
                self._actual_busy_s += now - rank.busy_since
                self._planned_busy_s += rank.planned_s
                rank.busy_since, rank.planned_s = now, 0.0
        late = sorted(self._lateness_s) or [0.0]
        return TimingStats(
            num_iterations=self._num_iterations,
            planned_busy_s=self._planned_busy_s,
            actual_busy_s=self._actual_busy_s,
            p50_late_ms=1000 * late[len(late) // 2],
            p99_late_ms=1000 * late[min(len(late) - 1, int(len(late) * 0.99))],
            max_late_ms=1000 * late[-1],
        )

    def reset_timing(self) -> None:
        self.timing_stats()
        self._num_iterations = 0
        self._planned_busy_s = self._actual_busy_s = 0.0
        self._lateness_s.clear()
