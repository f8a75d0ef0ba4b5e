"""The compute bound on capacity: the share of a fleet's peak compute that a workload's least work needs.

Above 1 the GPUs could not do the work even computing without pause, so no router or controller sustains
that load, whatever its placement or objectives: a target is checked against it before a policy is
blamed for missing it. The least work is counted generously to the fleet:

- a prompt token is computed only if no earlier request's prompt began with the same blocks (one prefix
  cache shared by every replica, never evicting; prompts without hash ids share nothing);
- each new token (uncached prompt or output) costs its weight FLOPs, and each (query, context) pair it
  attends over its attention FLOPs, at the compute roofline (``PerfModel.compute_floor_s``: no memory
  stall, communication or per-step overhead).

Work divides among replicas, so a fleet computes at the sum of its replicas' rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadtest.spec import HASH_BLOCK_TOKENS

if TYPE_CHECKING:
    from kernels.perf import PerfModel
    from loadtest.spec import Workload


@dataclass(frozen=True, slots=True)
class LeastWork:
    """What a workload makes any fleet compute at the least, per second of its traffic."""

    new_tokens_per_s: float  # prompt tokens no earlier prefix covers, plus output tokens
    attention_pairs_per_s: float  # (query token, context token) pairs those tokens attend over


def least_work(workload: Workload) -> LeastWork:
    """The workload's least work per second of its duration."""
    seen: set[tuple[int, ...]] = set()
    new_tokens = pairs = 0.0
    for spec in workload.specs:
        prefix: tuple[int, ...] = ()
        cached_blocks = 0
        for hash_id in spec.hash_ids:  # a block is cached only as part of a prefix seen whole
            prefix += (hash_id,)
            if prefix in seen:
                cached_blocks += 1
            else:
                seen.add(prefix)
        prompt, output = spec.input_tokens, spec.output_tokens
        cached = min(prompt, cached_blocks * HASH_BLOCK_TOKENS)
        new_tokens += prompt - cached + output
        # prompt token i attends over i tokens; output token j over the prompt and j outputs
        pairs += (prompt * prompt - cached * cached) / 2.0 + output * prompt + output * output / 2.0
    duration_s = max(workload.duration_s, 1e-9)
    return LeastWork(new_tokens / duration_s, pairs / duration_s)


def compute_load(work: LeastWork, replicas: Sequence[PerfModel]) -> float:
    """The share of the replicas' peak compute ``work`` needs (above 1: more than they can compute): one
    over the seconds of work per second they could compute together, each at its roofline."""
    rate = sum(1.0 / perf.compute_floor_s(work.new_tokens_per_s, work.attention_pairs_per_s) for perf in replicas)
    return 1.0 / rate if rate > 0 else float("inf")
