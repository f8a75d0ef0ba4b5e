"""Read an engine's Prometheus ``/metrics`` text into one ``EngineLoad``. Pure: text in, record out.

Each kind names the same few figures differently (checked against the engines' sources):

- sglang (and the emulated replicas, which speak sglang's names): ``sglang:num_running_reqs``,
  ``num_queue_reqs``, ``token_usage``, counters ``prompt_tokens_total``, ``cached_tokens_total``,
  ``generation_tokens_total``. Tensor- and pipeline-parallel ranks repeat their scheduler's figures
  under ``tp_rank``/``pp_rank`` labels, so only rank 0's series count; data-parallel ranks are summed.
- vLLM: ``vllm:num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (a 0..1
  fraction despite its name; ``gpu_cache_usage_perc`` before it), ``prefix_cache_queries_total`` and
  ``prefix_cache_hits_total`` (``gpu_prefix_cache_*`` before), ``prompt_tokens_total``,
  ``generation_tokens_total``; data-parallel engines (label ``engine``) are summed.
- llama.cpp (``llama-server --metrics``): ``llamacpp:requests_processing``, ``requests_deferred``,
  ``prompt_tokens_total`` (tokens evaluated, cached ones excluded), ``prompt_tokens_cached_total``,
  ``tokens_predicted_total``; ``kv_cache_usage_ratio`` only in older builds (newer ones export none).

Only the wanted names are looked up, with ``str.find`` over the text (C speed), instead of parsing every
histogram bucket line in Python: a vLLM scrape is mostly histograms the router never reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.engines.load import ENGINE_KINDS, EngineLoad


@dataclass(frozen=True, slots=True)
class _Names:
    """A kind's metric names per figure; where a figure has several, the first one exported wins
    (the current name first, then older engines' names)."""

    running: str
    waiting: str
    kv_usage: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    hits: tuple[str, ...] = ()
    prompt: tuple[str, ...] = ()
    generation: tuple[str, ...] = ()
    cached_prompt: bool = False  # prompt counts exclude cache hits (llama.cpp): add them back


_SGLANG = _Names(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
    queries=("sglang:prompt_tokens_total",),
    hits=("sglang:cached_tokens_total",),
    prompt=("sglang:prompt_tokens_total",),
    generation=("sglang:generation_tokens_total",),
)
_NAMES: Mapping[str, _Names] = {
    "emulated": _SGLANG,
    "sglang": _SGLANG,
    "vllm": _Names(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prompt=("vllm:prompt_tokens_total",),
        generation=("vllm:generation_tokens_total",),
    ),
    "llamacpp": _Names(
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        hits=("llamacpp:prompt_tokens_cached_total",),
        prompt=("llamacpp:prompt_tokens_total",),
        generation=("llamacpp:tokens_predicted_total",),
        cached_prompt=True,
    ),
}
assert set(_NAMES) == set(ENGINE_KINDS)

# A series of a tensor/pipeline-parallel rank other than 0 repeats rank 0's scheduler figures.
_RANK_COPY = re.compile(r'(?:^|,)\s*(?:tp_rank|pp_rank)="(?!0")')


def parse_load(kind: str, text: str, now: float) -> EngineLoad:
    """The load record in ``text`` (a ``/metrics`` answer of an engine of ``kind``), stamped ``now``.

    Counts are summed over a metric's label sets and fractions averaged; a figure the text lacks is 0
    (running, waiting) or None (the rest). Raises ValueError for an unknown kind, a sample value that
    is not a number, or a text with neither the running nor the waiting metric of the kind."""
    names = _NAMES.get(kind)
    if names is None:
        raise ValueError(f"unknown engine kind {kind!r} (expected one of: {', '.join(ENGINE_KINDS)})")
    body = "\n" + text  # every sample then starts right after a newline
    running = _values(body, names.running)
    waiting = _values(body, names.waiting)
    if not running and not waiting:
        raise ValueError(f"no {kind} load metrics ({names.running}, {names.waiting}) in the /metrics text")
    prompt = _first_sum(body, names.prompt)
    hits = _first_sum(body, names.hits)
    queries = prompt if names.queries == names.prompt else _first_sum(body, names.queries)
    if names.cached_prompt and prompt is not None:
        prompt += hits or 0.0
        queries = prompt if hits is not None else None
    kv = _first(body, names.kv_usage)
    return EngineLoad(
        scraped_at=now,
        num_running=round(sum(running)),
        num_waiting=round(sum(waiting)),
        kv_usage_fraction=sum(kv) / len(kv) if kv else None,
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=hits,
        prompt_tokens_total=prompt,
        generation_tokens_total=_first_sum(body, names.generation),
    )


def prefix_hit_fraction(previous: EngineLoad | None, current: EngineLoad) -> float | None:
    """Share of the prompt tokens looked up between two scrapes that the prefix cache held; None
    when the engine exports no such counters, nothing was looked up, or the counters were reset."""
    if previous is None:
        return None
    q0, h0 = previous.prefix_cache_queries_tokens, previous.prefix_cache_hits_tokens
    q1, h1 = current.prefix_cache_queries_tokens, current.prefix_cache_hits_tokens
    if q0 is None or h0 is None or q1 is None or h1 is None:
        return None
    queried, hit = q1 - q0, h1 - h0
    if queried <= 0 or hit < 0:
        return None
    return min(1.0, hit / queried)


def _first(body: str, names: tuple[str, ...]) -> list[float]:
    for name in names:
        values = _values(body, name)
        if values:
            return values
    return []


def _first_sum(body: str, names: tuple[str, ...]) -> float | None:
    values = _first(body, names)
    return sum(values) if values else None


def _values(body: str, name: str) -> list[float]:
    """The finite sample values of metric ``name`` in ``body`` (a newline, then the exposition text),
    one per label set that counts. Comments never match: their lines start with '#'. A metric's samples
    are one group of lines (the exposition format requires it), so the text is searched once, up to
    the group, and read on line by line while the lines name the metric."""
    needle = "\n" + name
    values: list[float] = []
    at = body.find(needle)
    while at != -1:
        pos = at + len(needle)
        eol = body.find("\n", pos)
        if eol == -1:
            eol = len(body)
        after = body[pos:pos + 1]
        if after == "{":
            close = body.rfind("}", pos, eol)
            if close == -1:
                raise ValueError(f"{name}: unterminated label set in {body[at + 1:eol][:200]!r}")
            rest = None if _RANK_COPY.search(body[pos + 1:close]) else body[close + 1:eol]
        elif after in (" ", "\t"):
            rest = body[pos:eol]
        else:  # another metric whose name starts with this one (sglang:num_running_reqs_offline_batch)
            at = body.find(needle, eol)
            continue
        if rest is not None:
            fields = rest.split()
            try:
                value = float(fields[0])
            except (IndexError, ValueError):
                raise ValueError(f"{name}: sample value {rest.strip()[:80]!r} is not a number") from None
            if math.isfinite(value):
                values.append(value)
        at = eol if body.startswith(needle, eol) else -1
    return values
