"""The one load record every engine's ``/metrics`` is read into."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_KINDS = ("emulated", "sglang", "vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a replica's engine says about itself at ``scraped_at`` (the reader's clock, seconds).

    ``None`` marks a figure this engine does not export. Counters (tokens, cache queries and hits) are
    cumulative, as the engine exports them; rates come from two records' difference."""

    scraped_at: float
    num_running: int  # requests the engine is computing (in its running batch)
    num_waiting: int  # requests queued inside the engine, not yet admitted to a batch
    kv_usage_fraction: float | None = None  # share of the KV cache in use, 0..1
    prefix_cache_queries_tokens: float | None = None  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits_tokens: float | None = None  # cumulative prompt tokens found there
    prompt_tokens_total: float | None = None  # cumulative prompt tokens processed
    generation_tokens_total: float | None = None  # cumulative tokens generated

    @property
    def num_requests(self) -> int:
        """Everything the engine holds: running plus waiting."""
        return self.num_running + self.num_waiting
