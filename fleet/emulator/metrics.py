"""sglang's Prometheus metrics, as the emulated replica exports them on GET /metrics.

Names follow sglang's metrics collector (python/sglang/srt/metrics/collector.py): engine gauges
``sglang:num_running_reqs``, ``num_queue_reqs``, ``num_used_tokens``, ``token_usage``,
``cache_hit_rate``, ``gen_throughput``; counters ``prompt_tokens_total``,
``generation_tokens_total``, ``cached_tokens_total``, ``num_requests_total``; histograms
``time_to_first_token_seconds`` and ``e2e_request_latency_seconds``; all labelled ``model_name``.
Rendered by hand: a scrape is a handful of lines and needs no registry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from kernels.engine_types import EngineStats


class Histogram:
    """Cumulative-bucket histogram in Prometheus' shape."""

    __slots__ = ("buckets", "counts", "total", "num")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, num in zip(self.buckets, self.counts, strict=False):
            cumulative += num
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.num)}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {float(self.num)}")
        return lines


_GAUGES = (
    ("num_running_reqs", "The number of running requests.", "num_running"),
    ("num_queue_reqs", "The number of requests in the waiting queue.", "num_waiting"),
    ("num_used_tokens", "The number of used tokens.", "kv_used_tokens"),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", "kv_capacity_tokens"),
    ("token_usage", "The token usage.", "token_usage"),
    ("cache_hit_rate", "The prefix cache hit rate.", "cache_hit_rate"),
    ("gen_throughput", "The generation throughput (token/s).", "gen_throughput_tok_s"),
)
_COUNTERS = (
    ("prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens_total"),
    ("generation_tokens", "Number of generation tokens processed.", "num_generation_tokens_total"),
    ("cached_tokens", "Number of cached prompt tokens.", "num_cached_tokens_total"),
    ("num_requests", "Number of requests processed.", "num_finished"),
    ("num_aborted_requests", "Number of requests aborted.", "num_aborted"),
    ("num_retractions", "Number of requests retracted (preempted) for lack of KV memory.", "num_preemptions"),
)


def render_metrics(model_name: str, stats: EngineStats, ttft_s: Histogram, e2e_s: Histogram) -> str:
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    labels = f'model_name="{escaped}"'
    lines: list[str] = []
    for short, help_text, attr in _GAUGES:
        name = f"sglang:{short}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(getattr(stats, attr))}"]
    for short, help_text, attr in _COUNTERS:
        name = f"sglang:{short}"
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} counter",
            f"{name}_total{{{labels}}} {float(getattr(stats, attr))}",
        ]
    lines += ttft_s.render("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels)
    lines += e2e_s.render("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", labels)
    return "\n".join(lines) + "\n"
