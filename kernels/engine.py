"""A clock-agnostic continuous-batching scheduler modelled on sglang's, timed by a performance model.

One engine, two clocks: the emulated replica drives it with the wall clock, a fleet simulator with a
virtual one. Either way the caller owns time and I/O and the engine only plans and applies::

    plan = engine.schedule(now)              # None when idle
    ...  wait plan.duration_s  ...
    outputs = engine.update(plan, plan.ended_at)

How ``schedule`` builds an iteration (sglang's scheduler, simplified where noted):

1. Decode: every running request whose prefill is done gets KV room for the tokens it emits this
   step (several with speculative decoding), oldest first. When memory runs out, unreferenced prefix
   blocks are evicted (LRU), then the newest running request is preempted: its KV is dropped and it
   goes back to the front of the queue to be recomputed (prompt plus the tokens it already emitted).
2. Prefill: a token budget of ``min(max_prefill_tokens, chunked_prefill_size)`` minus the decode
   tokens (mixed prefill+decode iterations) first continues the request being prefilled in chunks,
   then admits waiting requests (fcfs, or longest cached prefix first for ``lpm``) while
   ``max_running_requests`` allows and KV can hold the request's uncached prompt plus a reserve for
   its future tokens and everyone else's (``new_token_ratio`` of their remaining ``max_new_tokens``,
   decaying as decode runs and reset by a preemption, as sglang does). A prompt longer than the
   budget is split into chunks. Cached prefix blocks are skipped and locked.
3. A pure-decode iteration with nothing admissible may be fast-forwarded (``horizon_s > 0``): the
   same batch runs ``num_steps`` iterations in one plan, timed in closed form, until the earliest of a
   completion, KV exhaustion and the horizon. Token counts equal stepping one by one exactly.

Speculative decoding emits ``perf.spec_tokens_per_step(domain, batch)`` tokens per step on average;
the fraction is carried per request in fixed point so that totals are exact and deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kernels.config import EngineConfig
from kernels.engine_state import (
    CLIP_MAX_NEW_TOKENS,
    SPEC_ONE,
    PerfModelLike,
    SchedulerLimits,
    SeqState,
    emitted_tokens,
    steps_to_finish,
)
from kernels.engine_types import EngineRequest, EngineStats, IterationPlan, StepOutputs
from kernels.kvcache import KVCache, chain_block_keys
from kernels.perf import IterationShape

_INIT_NEW_TOKEN_RATIO = 0.7  # sglang init_new_token_ratio at schedule_conservativeness 1
_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY_STEPS = 600
_LPM_MAX_QUEUE = 128  # sglang falls back to fcfs above this queue length (matching gets expensive)
_THROUGHPUT_WINDOW_S = 5.0
DEFAULT_PREFIX_BLOCK_TOKENS = 512  # Mooncake traces name prompts in 512-token blocks


class Engine:
    """sglang-like scheduler for one data-parallel rank; see the module docstring for the algorithm."""

    def __init__(
        self,
        perf: PerfModelLike,
        config: EngineConfig,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    ) -> None:
        self.perf = perf
        self.config = config
        self.limits = SchedulerLimits.from_config(config, perf.kv_capacity_tokens)
        if prefix_block_tokens % self.limits.page_size:
            raise ValueError(
                f"prefix_block_tokens ({prefix_block_tokens}) must be a multiple of page_size ({self.limits.page_size})"
            )
        self.prefix_block_tokens = prefix_block_tokens
        num_pages = perf.kv_capacity_tokens // self.limits.page_size
        self.kv = KVCache(num_pages, self.limits.page_size, prefix_block_tokens, self.limits.enable_prefix_caching)
        self._waiting: deque[SeqState] = deque()
        self._running: dict[str, SeqState] = {}  # admission order: the last is the first to be preempted
        self._id_to_seq: dict[str, SeqState] = {}
        self._in_flight: IterationPlan | None = None
        self._num_ratio_steps = 0  # decode steps since the new-token ratio was last reset
        self._spec_cache: dict[tuple[str, int], int] = {}
        self._recent_tokens: deque[tuple[float, int]] = deque()  # (ended_at, tokens) for throughput
        self._num_preemptions = 0
        self._num_finished = 0
        self._num_aborted = 0
        self._num_prompt_tokens_total = 0
        self._num_cached_tokens_total = 0
        self._num_generation_tokens_total = 0

    # --- requests in and out ---------------------------------------------------------------------
    def add_request(self, req: EngineRequest, now: float) -> bool:
        """Queue a request; False when it can never fit in KV memory (the caller rejects it)."""
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(f"request {req.req_id!r} needs >= 1 prompt and output token")
        if req.req_id in self._id_to_seq:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        if self.kv.pages_for(req.prompt_tokens + req.output_tokens) > self.kv.num_pages:
            return False
        seq = SeqState(req, chain_block_keys(req.prefix_hash_ids))
        self._id_to_seq[req.req_id] = seq
        self._waiting.append(seq)
        return True

    def abort(self, req_id: str, now: float) -> bool:
        """Drop a request wherever it is (a plan in flight skips it); False if it is not here."""
        seq = self._id_to_seq.pop(req_id, None)
        if seq is None:
            return False
        if self._running.pop(req_id, None) is not None:
            self._release(seq)
        else:
            self._waiting.remove(seq)
        self._num_aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self._id_to_seq)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._id_to_seq

    # --- plan ------------------------------------------------------------------------------------
    def schedule(self, now: float, horizon_s: float = 0.0) -> IterationPlan | None:
        """Decide the next iteration (see the module docstring); None when there is nothing to run.

        ``horizon_s > 0`` lets a pure-decode iteration run on for several steps, stopping at the
        first step boundary at or after ``now + horizon_s`` (the caller's next event).
        """
        assert self._in_flight is None, "schedule() called twice without update()"
        preempted: list[SeqState] = []
        decode_seqs = self._reserve_decode(preempted)
        chunks = self._plan_prefill(len(decode_seqs), preempted)
        if not decode_seqs and not chunks:
            assert not preempted, "preempted requests but scheduled nothing"
            if not self._running:
                self._num_ratio_steps = 0
            return None
        num_steps = 1
        if horizon_s > 0.0 and not chunks and not preempted and self._queue_is_blocked():
            num_steps = self._fast_forward_steps(decode_seqs, horizon_s)
        plan = self._make_plan(now, num_steps, decode_seqs, chunks, preempted)
        self._check_invariants(plan)
        self._in_flight = plan
        return plan

    def cut(self, plan: IterationPlan, at: float) -> IterationPlan:
        """Shorten the fast-forwarded ``plan`` in flight to the first step boundary at or after ``at``.

        For a caller whose clock learns of an arrival mid-stretch: the prefix replaces the plan in
        flight (``update`` takes it) and the newcomer is admitted at its end, as a stepping engine
        would. KV reserved for the dropped steps stays with the requests and serves their next
        steps. ``plan`` itself is returned when there is nothing to cut: one step, ``at`` past its
        end, or a request of its batch aborted since (the stretch's timing no longer applies).
        """
        assert plan is self._in_flight, "cut() needs the plan in flight"
        if plan.num_steps <= 1 or at >= plan.ended_at:
            return plan
        decode_seqs = [self._running.get(req_id) for req_id in plan.decode_req_ids]
        if any(seq is None for seq in decode_seqs):
            return plan
        num_seqs = len(decode_seqs)
        mean_rate = sum(self._tokens_per_step(seq, num_seqs) for seq in decode_seqs if seq is not None) / (num_seqs * SPEC_ONE)
        context = plan.shape.sum_decode_context
        elapsed = at - plan.started_at
        low, high = 1, plan.num_steps  # the smallest number of steps whose stretch reaches `elapsed`
        while low < high:
            mid = (low + high) // 2
            if self.perf.decode_run_time_s(num_seqs, context, mid, mean_rate) >= elapsed:
                high = mid
            else:
                low = mid + 1
        num_steps = low
        if num_steps >= plan.num_steps:
            return plan
        cut = replace(plan, num_steps=num_steps, duration_s=self.perf.decode_run_time_s(num_seqs, context, num_steps, mean_rate))
        self._in_flight = cut
        return cut

    def _reserve_decode(self, preempted: list[SeqState]) -> list[SeqState]:
        """KV room for one decode step per decoding request, preempting the newest on shortage.

        Repeats until no preemption happens, because a smaller batch may emit more speculative
        tokens per step and so need more room.
        """
        while True:
            num_preempted = len(preempted)
            decode_seqs = [seq for seq in self._running.values() if seq.is_decoding]
            for seq in decode_seqs:
                if seq.req.req_id not in self._running:
                    continue  # preempted to make room for an older request
                rate = self._tokens_per_step(seq, len(decode_seqs))
                emit, _ = emitted_tokens(seq.spec_credit, rate, 1, seq.num_remaining_tokens)
                self._grow_or_preempt(seq, seq.num_context_tokens + emit, preempted)
            if len(preempted) == num_preempted:
                break
            self._num_ratio_steps = 0
        return decode_seqs

    def _grow_or_preempt(self, seq: SeqState, num_context_tokens: int, preempted: list[SeqState]) -> bool:
        """Room for ``seq`` to reach ``num_context_tokens``, preempting the newest until it fits or is gone."""
        while not self._grow_private(seq, num_context_tokens):
            victim = self._preempt_newest()
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _plan_prefill(self, num_decode_seqs: int, preempted: list[SeqState]) -> list[tuple[SeqState, int]]:
        limits = self.limits
        budget = limits.max_prefill_tokens
        if limits.chunked_prefill_size is not None:
            budget = min(budget, limits.chunked_prefill_size)
        budget -= num_decode_seqs
        chunks: list[tuple[SeqState, int]] = []
        for seq in [s for s in self._running.values() if not s.is_decoding]:
            if budget <= 0 or seq.req.req_id not in self._running:
                continue
            take = min(seq.num_prefill_target - seq.num_context_tokens, budget)
            # With decodes running, memory comes back as they finish (or they preempt); preempting
            # them here would pull requests out of a plan already decided.
            fits = (
                self._grow_or_preempt(seq, seq.num_context_tokens + take, preempted)
                if num_decode_seqs == 0
                else self._grow_private(seq, seq.num_context_tokens + take)
            )
            if fits:
                chunks.append((seq, take))
                budget -= take
        if budget > 0 and self._waiting:
            self._admit(budget, chunks)
        return chunks

    def _admit(self, budget: int, chunks: list[tuple[SeqState, int]]) -> None:
        """Move waiting requests into the batch while budget, running cap and KV allow."""
        limits, kv = self.limits, self.kv
        if limits.schedule_policy == "lpm" and len(self._waiting) <= _LPM_MAX_QUEUE:
            self._sort_waiting_by_prefix()
        ratio = self._new_token_ratio()
        reserved_pages = kv.pages_for(sum(seq.reserve_tokens(ratio) for seq in self._running.values()))
        while self._waiting and budget > 0 and len(self._running) < limits.max_running_requests:
            seq = self._waiting[0]
            max_blocks = (seq.num_prefill_target - 1) // self.prefix_block_tokens
            num_matched = kv.match(seq.block_keys, max_blocks)
            num_cached = num_matched * self.prefix_block_tokens
            num_extend = seq.num_prefill_target - num_cached
            if limits.chunked_prefill_size is None and num_extend > budget and chunks:
                break
            take = num_extend if limits.chunked_prefill_size is None else min(num_extend, budget)
            seq_reserve_pages = kv.pages_for(round(ratio * min(seq.max_new_tokens - seq.num_output_tokens, CLIP_MAX_NEW_TOKENS)))
            matched_keys = seq.block_keys[:num_matched]
            available = kv.num_available_pages - kv.block_pages * kv.num_unreferenced_among(matched_keys)
            need = kv.pages_for(num_extend)
            if self._running:  # an empty engine always takes the head, or a huge max_tokens would starve
                need += seq_reserve_pages + reserved_pages
            if need > available:
                break
            self._waiting.popleft()
            kv.lock(matched_keys)
            seq.num_shared_blocks = num_matched
            seq.num_context_tokens = num_cached
            seq.num_cached_tokens = num_cached
            assert self._grow_private(seq, num_cached + take), "admission check let through a request that does not fit"
            if not seq.was_admitted:
                seq.was_admitted = True
                self._num_prompt_tokens_total += seq.req.prompt_tokens
                self._num_cached_tokens_total += num_cached
            self._running[seq.req.req_id] = seq
            reserved_pages += seq_reserve_pages
            budget -= take
            chunks.append((seq, take))

    def _sort_waiting_by_prefix(self) -> None:
        def matched(seq: SeqState) -> int:
            return -self.kv.match(seq.block_keys, (seq.num_prefill_target - 1) // self.prefix_block_tokens)

        self._waiting = deque(sorted(self._waiting, key=matched))  # stable: fcfs among equals

    def _queue_is_blocked(self) -> bool:
        """True when no step of a pure-decode stretch could admit anyone (so stepping may be skipped)."""
        return not self._waiting or len(self._running) >= self.limits.max_running_requests

    def _fast_forward_steps(self, decode_seqs: list[SeqState], horizon_s: float) -> int:
        """Steps until the first completion, KV exhaustion or the horizon, whichever is first."""
        num_seqs = len(decode_seqs)
        rates = [self._tokens_per_step(seq, num_seqs) for seq in decode_seqs]
        num_steps = min(
            steps_to_finish(seq.spec_credit, rate, seq.num_remaining_tokens)
            for seq, rate in zip(decode_seqs, rates, strict=True)
        )
        if num_steps > 1 and self._extra_pages(decode_seqs, rates, num_steps) > self.kv.num_available_pages:
            num_steps = self._bisect_last(1, num_steps, lambda k: self._extra_pages(decode_seqs, rates, k) <= self.kv.num_available_pages)
        if num_steps > 1:
            sum_context = sum(seq.num_context_tokens for seq in decode_seqs)
            mean_rate = sum(rates) / (num_seqs * SPEC_ONE)

            def ends_before_horizon(k: int) -> bool:
                return self.perf.decode_run_time_s(num_seqs, sum_context, k, mean_rate) < horizon_s

            if not ends_before_horizon(num_steps):
                # the stretch ends at the first step that reaches the horizon
                num_steps = min(num_steps, self._bisect_last(0, num_steps, ends_before_horizon) + 1)
        for seq, rate in zip(decode_seqs, rates, strict=True):
            emit, _ = emitted_tokens(seq.spec_credit, rate, num_steps, seq.num_remaining_tokens)
            assert self._grow_private(seq, seq.num_context_tokens + emit)
        return num_steps

    @staticmethod
    def _bisect_last(low: int, high: int, holds: Callable[[int], bool]) -> int:
        """Largest k in [low, high] with holds(k), given holds(low) and monotone holds."""
        while low < high:
            mid = (low + high + 1) // 2
            if holds(mid):
                low = mid
            else:
                high = mid - 1
        return low

    def _extra_pages(self, decode_seqs: list[SeqState], rates: list[int], num_steps: int) -> int:
        extra = 0
        for seq, rate in zip(decode_seqs, rates, strict=True):
            emit, _ = emitted_tokens(seq.spec_credit, rate, num_steps, seq.num_remaining_tokens)
            need = self.kv.pages_for(self._private_tokens(seq, seq.num_context_tokens + emit))
            extra += max(0, need - seq.num_private_pages)
        return extra

    def _make_plan(
        self,
        now: float,
        num_steps: int,
        decode_seqs: list[SeqState],
        chunks: list[tuple[SeqState, int]],
        preempted: list[SeqState],
    ) -> IterationPlan:
        num_prefill_tokens = sum(take for _, take in chunks)
        shape = IterationShape(
            num_decode_seqs=len(decode_seqs),
            sum_decode_context=sum(seq.num_context_tokens for seq in decode_seqs),
            num_prefill_tokens=num_prefill_tokens,
            prefill_attn_pairs=sum(take * (seq.num_context_tokens + take / 2) for seq, take in chunks),
            num_prefill_seqs=len(chunks),
        )
        if num_steps == 1:
            duration_s = self.perf.iteration_time(shape).total_s
        else:
            num_seqs = len(decode_seqs)
            mean_rate = sum(self._tokens_per_step(seq, num_seqs) for seq in decode_seqs) / (num_seqs * SPEC_ONE)
            duration_s = self.perf.decode_run_time_s(num_seqs, shape.sum_decode_context, num_steps, mean_rate)
        return IterationPlan(
            started_at=now,
            duration_s=duration_s,
            num_steps=num_steps,
            decode_req_ids=tuple(seq.req.req_id for seq in decode_seqs),
            prefill_req_ids=tuple(seq.req.req_id for seq, _ in chunks),
            prefill_num_tokens=tuple(take for _, take in chunks),
            preempted_req_ids=tuple(seq.req.req_id for seq in preempted),
            shape=shape,
        )

    def _check_invariants(self, plan: IterationPlan) -> None:
        limits = self.limits
        assert len(self._running) <= limits.max_running_requests
        assert 0 <= self.kv.num_used_pages <= self.kv.num_pages
        if limits.chunked_prefill_size is not None:
            assert plan.num_prefill_tokens + len(plan.decode_req_ids) <= max(
                min(limits.max_prefill_tokens, limits.chunked_prefill_size), len(plan.decode_req_ids)
            )
        assert plan.num_steps == 1 or plan.is_pure_decode

    # --- apply -----------------------------------------------------------------------------------
    def update(self, plan: IterationPlan, now: float) -> StepOutputs:
        """Apply a plan's results at ``now`` (when it ended); requests aborted meanwhile are skipped."""
        assert plan is self._in_flight, "update() needs the plan the last schedule() returned"
        self._in_flight = None
        new_ids: list[str] = []
        new_counts: list[int] = []
        first_ids: list[str] = []
        first_cached: list[int] = []
        finished: list[str] = []
        for req_id, take in zip(plan.prefill_req_ids, plan.prefill_num_tokens, strict=True):
            seq = self._running.get(req_id)
            if seq is None:
                continue
            seq.num_context_tokens += take
            if seq.num_context_tokens < seq.num_prefill_target:
                continue
            seq.is_decoding = True
            self._share_prompt_blocks(seq)
            if seq.num_output_tokens == 0:
                first_ids.append(req_id)
                first_cached.append(seq.num_cached_tokens)
            self._emit(seq, 1, new_ids, new_counts, finished)
        num_decode = len(plan.decode_req_ids)
        for req_id in plan.decode_req_ids:
            seq = self._running.get(req_id)
            if seq is None:
                continue
            emit, seq.spec_credit = emitted_tokens(
                seq.spec_credit, self._tokens_per_step(seq, num_decode), plan.num_steps, seq.num_remaining_tokens
            )
            seq.num_context_tokens += emit  # their KV was reserved at schedule time
            self._emit(seq, emit, new_ids, new_counts, finished)
        if num_decode:
            self._num_ratio_steps += plan.num_steps
        outputs = StepOutputs(
            ended_at=now,
            num_steps=plan.num_steps,
            new_token_req_ids=tuple(new_ids),
            num_new_tokens=tuple(new_counts),
            first_token_req_ids=tuple(first_ids),
            first_token_num_cached=tuple(first_cached),
            finished_req_ids=tuple(finished),
        )
        self._record_throughput(now, outputs.num_tokens)
        return outputs

    def _emit(self, seq: SeqState, num_tokens: int, new_ids: list[str], new_counts: list[int], finished: list[str]) -> None:
        req_id = seq.req.req_id
        seq.num_output_tokens += num_tokens
        new_ids.append(req_id)
        new_counts.append(num_tokens)
        self._num_generation_tokens_total += num_tokens
        if seq.num_output_tokens >= seq.req.output_tokens:
            assert seq.num_output_tokens == seq.req.output_tokens
            finished.append(req_id)
            del self._running[req_id]
            del self._id_to_seq[req_id]
            self._release(seq)
            self._num_finished += 1

    # --- KV helpers ------------------------------------------------------------------------------
    def _private_tokens(self, seq: SeqState, num_context_tokens: int) -> int:
        return num_context_tokens - seq.num_shared_blocks * self.prefix_block_tokens

    def _grow_private(self, seq: SeqState, num_context_tokens: int) -> bool:
        """Make the request's private pages cover ``num_context_tokens``; False if memory is short."""
        need = self.kv.pages_for(self._private_tokens(seq, num_context_tokens)) - seq.num_private_pages
        if need > 0:
            if not self.kv.allocate(need):
                return False
            seq.num_private_pages += need
        return True

    def _share_prompt_blocks(self, seq: SeqState) -> None:
        """After prefill, move the prompt's whole named blocks from private pages into the prefix cache."""
        num_full = min(len(seq.block_keys), seq.req.prompt_tokens // self.prefix_block_tokens)
        if num_full <= seq.num_shared_blocks or not self.kv.enable_prefix_cache:
            return
        self.kv.free(seq.num_private_pages)
        seq.num_shared_blocks += self.kv.share(seq.block_keys[seq.num_shared_blocks : num_full])
        seq.num_private_pages = self.kv.pages_for(self._private_tokens(seq, seq.num_context_tokens))
        assert self.kv.allocate(seq.num_private_pages), "sharing blocks must not need more pages"

    def _release(self, seq: SeqState) -> None:
        self.kv.free(seq.num_private_pages)
        self.kv.release(seq.block_keys[: seq.num_shared_blocks])
        seq.num_private_pages = 0
        seq.num_shared_blocks = 0

    def _preempt_newest(self) -> SeqState:
        req_id, seq = self._running.popitem()
        self._release(seq)
        seq.reset()
        self._waiting.appendleft(seq)
        self._num_preemptions += 1
        return seq

    # --- small derived figures -------------------------------------------------------------------
    def _tokens_per_step(self, seq: SeqState, num_decode_seqs: int) -> int:
        key = (seq.req.domain, num_decode_seqs)
        rate = self._spec_cache.get(key)
        if rate is None:
            rate = max(SPEC_ONE, round(self.perf.spec_tokens_per_step(*key) * SPEC_ONE))
            self._spec_cache[key] = rate
        return rate

    def _new_token_ratio(self) -> float:
        decay = (_INIT_NEW_TOKEN_RATIO - _MIN_NEW_TOKEN_RATIO) / _NEW_TOKEN_RATIO_DECAY_STEPS
        return max(_MIN_NEW_TOKEN_RATIO, _INIT_NEW_TOKEN_RATIO - self._num_ratio_steps * decay)

    def _record_throughput(self, now: float, num_tokens: int) -> None:
        recent = self._recent_tokens
        if num_tokens:
            recent.append((now, num_tokens))
        while recent and recent[0][0] <= now - _THROUGHPUT_WINDOW_S:
            recent.popleft()

    # --- views -----------------------------------------------------------------------------------
    def stats(self, now: float) -> EngineStats:
        self._record_throughput(now, 0)
        page_size = self.kv.page_size
        prompt_total = self._num_prompt_tokens_total
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_used_tokens=self.kv.num_used_pages * page_size,
            kv_capacity_tokens=self.kv.num_pages * page_size,
            cache_hit_rate=self._num_cached_tokens_total / prompt_total if prompt_total else 0.0,
            gen_throughput_tok_s=sum(n for _, n in self._recent_tokens) / _THROUGHPUT_WINDOW_S,
            num_preemptions=self._num_preemptions,
            num_finished=self._num_finished,
            num_aborted=self._num_aborted,
            num_prompt_tokens_total=prompt_total,
            num_cached_tokens_total=self._num_cached_tokens_total,
            num_generation_tokens_total=self._num_generation_tokens_total,
        )

    def waiting_req_ids(self) -> tuple[str, ...]:
        return tuple(seq.req.req_id for seq in self._waiting)

    def running_req_ids(self) -> tuple[str, ...]:
        return tuple(self._running)

    def num_output_tokens(self, req_id: str) -> int:
        seq = self._id_to_seq.get(req_id)
        return seq.num_output_tokens if seq is not None else 0


def run_until(engine: Engine, now: float, until: float) -> tuple[float, list[StepOutputs]]:
    """Drive ``engine`` on a virtual clock from ``now`` to ``until`` (fast-forwarding decode stretches).

    Returns the clock after the last iteration (>= ``until`` when work remained, else the time the
    engine went idle) and every step's outputs. A convenience for simulators and tests.
    """
    outputs: list[StepOutputs] = []
    while now < until:
        plan = engine.schedule(now, horizon_s=until - now)
        if plan is None:
            break
        now = plan.ended_at
        outputs.append(engine.update(plan, now))
    return now, outputs
