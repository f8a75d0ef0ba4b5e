"""Values the engine scheduler takes in and hands out: requests, iteration plans, step outputs, stats.

Everything handed out is a frozen, slotted dataclass of ids and numbers built fresh on each call, so
a caller that keeps a plan or an output never sees it change when the engine moves on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class EngineRequest:
    """One generation request as the engine sees it: token counts, not text.

    ``output_tokens`` is how many tokens the request will generate (the emulator decides it up front;
    a trace replays it). ``max_new_tokens`` is what the client allowed, which is all a real engine
    knows when it reserves KV for future tokens; 0 means "same as output_tokens".
    ``prefix_hash_ids`` names the prompt's leading blocks of ``Engine.prefix_block_tokens`` tokens,
    one id per block (Mooncake-trace style); equal leading ids mean an equal prefix.
    """

    req_id: str
    prompt_tokens: int
    output_tokens: int
    domain: str = "chat"
    prefix_hash_ids: tuple[int, ...] = ()
    arrived_at: float = 0.0
    max_new_tokens: int = 0


class IterationShapeLike(Protocol):
    # read-only members, so a frozen dataclass (perf.IterationShape) satisfies the protocol
    @property
    def num_decode_seqs(self) -> int: ...
    @property
    def sum_decode_context(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """What the next engine iteration runs, decided by ``Engine.schedule`` and applied by ``update``.

    ``num_steps`` is 1 for an ordinary iteration. A fast-forwarded pure-decode stretch has
    ``num_steps > 1``: the same decode batch runs that many iterations back to back and
    ``duration_s`` covers them all.
    """

    started_at: float
    duration_s: float
    num_steps: int
    decode_req_ids: tuple[str, ...]
    prefill_req_ids: tuple[str, ...]
    prefill_num_tokens: tuple[int, ...]
    preempted_req_ids: tuple[str, ...]
    shape: IterationShapeLike = field(compare=False)

    @property
    def ended_at(self) -> float:
        return self.started_at + self.duration_s

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_num_tokens)

    @property
    def is_pure_decode(self) -> bool:
        return not self.prefill_req_ids


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What one applied plan produced.

    ``new_token_req_ids[i]`` emitted ``num_new_tokens[i]`` tokens. ``first_token_req_ids`` finished
    their prefill in this plan (their first token is among the new tokens) and
    ``first_token_num_cached[i]`` prompt tokens of each came from the prefix cache.
    ``finished_req_ids`` emitted their last token and left the engine.
    """

    ended_at: float
    num_steps: int
    new_token_req_ids: tuple[str, ...]
    num_new_tokens: tuple[int, ...]
    first_token_req_ids: tuple[str, ...]
    first_token_num_cached: tuple[int, ...]
    finished_req_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (the figures sglang exports on /metrics)."""

    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    cache_hit_rate: float
    gen_throughput_tok_s: float
    num_preemptions: int
    num_finished: int
    num_aborted: int
    num_prompt_tokens_total: int
    num_cached_tokens_total: int
    num_generation_tokens_total: int

    @property
    def token_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
