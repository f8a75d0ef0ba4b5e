"""The engine's internal pieces: the performance-model protocol it needs, the scheduler limits it
resolves from the config, and per-request scheduler state (never handed out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kernels.config import EngineConfig
from kernels.engine_types import EngineRequest
from kernels.perf import IterationShape

SPEC_BITS = 16  # fixed-point fraction bits for speculative tokens-per-step credit
SPEC_ONE = 1 << SPEC_BITS
_SPEC_MASK = SPEC_ONE - 1
CLIP_MAX_NEW_TOKENS = 4096  # sglang SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
_DEFAULT_CHUNKED_PREFILL_SIZE = 8192
_MAX_RUNNING_REQUESTS_CAP = 4096


class IterationTimeLike(Protocol):
    @property
    def total_s(self) -> float: ...


class PerfModelLike(Protocol):
    """What the engine asks of a performance model (the roofline and table-driven models both fit)."""

    @property
    def kv_capacity_tokens(self) -> int: ...

    def iteration_time(self, shape: IterationShape) -> IterationTimeLike: ...

    def decode_run_time_s(
        self, num_decode_seqs: int, sum_context: int, num_steps: int, tokens_per_step: float = 1.0
    ) -> float: ...

    def spec_tokens_per_step(self, domain: str, num_decode_seqs: int) -> float: ...


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The config knobs the scheduler obeys, with sglang's start-up resolution of the automatic ones."""

    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None  # None: prompts are never split
    page_size: int
    enable_prefix_caching: bool
    schedule_policy: str

    @classmethod
    def from_config(cls, config: EngineConfig, kv_capacity_tokens: int) -> SchedulerLimits:
        if config.max_running_requests is not None:
            max_running = config.max_running_requests
        else:
            max_running = max(1, min(_MAX_RUNNING_REQUESTS_CAP, kv_capacity_tokens // 2))
        chunk = config.chunked_prefill_size
        if chunk is None:
            chunk = _DEFAULT_CHUNKED_PREFILL_SIZE
        return cls(
            max_running_requests=max_running,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=None if chunk == -1 else chunk,
            page_size=config.page_size,
            enable_prefix_caching=config.enable_prefix_caching,
            schedule_policy=config.schedule_policy,
        )


class SeqState:
    """Mutable per-request scheduler state (internal; never handed out)."""

    __slots__ = (
        "req",
        "block_keys",
        "max_new_tokens",
        "num_output_tokens",
        "num_context_tokens",
        "num_prefill_target",
        "num_shared_blocks",
        "num_private_pages",
        "num_cached_tokens",
        "spec_credit",
        "is_decoding",
        "was_admitted",
    )

    def __init__(self, req: EngineRequest, block_keys: tuple[int, ...]) -> None:
        self.req = req
        self.block_keys = block_keys
        self.max_new_tokens = max(req.max_new_tokens, req.output_tokens)
        self.num_output_tokens = 0
        self.spec_credit = 0
        self.was_admitted = False
        self.reset()

    def reset(self) -> None:
        """Back to "nothing computed" (new, or preempted for recompute); emitted tokens are kept."""
        self.num_context_tokens = 0
        self.num_prefill_target = self.req.prompt_tokens + self.num_output_tokens
        self.num_shared_blocks = 0
        self.num_private_pages = 0
        self.num_cached_tokens = 0
        self.is_decoding = False

    @property
    def num_remaining_tokens(self) -> int:
        return self.req.output_tokens - self.num_output_tokens

    def reserve_tokens(self, new_token_ratio: float) -> int:
        """Future tokens admission keeps room for: the rest of the prompt, and a share of new tokens."""
        num_new = min(self.max_new_tokens - self.num_output_tokens, CLIP_MAX_NEW_TOKENS)
        return self.num_prefill_target - self.num_context_tokens + round(new_token_ratio * num_new)


def emitted_tokens(credit: int, tokens_per_step: int, num_steps: int, num_remaining: int) -> tuple[int, int]:
    """Tokens emitted over ``num_steps`` decode steps and the fractional credit carried on."""
    total = credit + num_steps * tokens_per_step
    return min(total >> SPEC_BITS, num_remaining), total & _SPEC_MASK


def steps_to_finish(credit: int, tokens_per_step: int, num_remaining: int) -> int:
    return max(1, -(-(num_remaining * SPEC_ONE - credit) // tokens_per_step))
