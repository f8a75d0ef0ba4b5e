"""Proposers: where the next candidate configurations come from. Whatever they return, the search
parses it, checks it against the search space and runs every gate before evaluating it.

`CoordinateProposer` (deterministic, the default) steps one knob at a time to a neighbouring value
of the incumbent (then two steps, then any other value), knobs that address the current bottleneck
first; it returns nothing once every one-knob move has been tried, which ends the search.
`AgentProposer` asks an LLM behind any OpenAI-compatible endpoint for candidates as JSON, given a
structured summary of the search."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.evaluators import Metrics
from kernels.compiler.shape import TrafficShape
from kernels.compiler.space import KNOBS, SearchSpace, knob_value, with_knob
from kernels.compiler.store import config_key
from kernels.config import EngineConfig

LLM_URL_ENV = "POLYMORPH_COMPILER_LLM_URL"
LLM_MODEL_ENV = "POLYMORPH_COMPILER_LLM_MODEL"
LLM_KEY_ENV = "POLYMORPH_COMPILER_LLM_KEY"

# Knobs to try first for each bottleneck (the rest follow in KNOBS order).
_BOTTLENECK_KNOBS = {
    "kv-capacity": ("kv_cache_dtype", "mem_fraction_static", "quantization", "tp", "enable_prefix_caching"),
    "queueing": ("chunked_prefill_size", "max_prefill_tokens", "max_running_requests", "schedule_policy", "tp"),
    "memory-bound": ("speculative", "quantization", "kv_cache_dtype", "cuda_graph_max_bs", "tp"),
    "compute-bound": ("quantization", "max_running_requests", "chunked_prefill_size", "speculative", "tp"),
}


@dataclass(frozen=True, slots=True)
class TrialView:
    """A trial as proposers see it: the configuration and either its metrics or why it was rejected."""

    config: EngineConfig
    metrics: Metrics | None
    rejected_reason: str = ""


@dataclass(frozen=True, slots=True)
class SearchContext:
    model: ModelSpec
    gpu: GpuSpec
    num_gpus: int
    shape: TrafficShape
    objective: str
    space: SearchSpace
    incumbent: EngineConfig
    incumbent_metrics: Metrics
    history: tuple[TrialView, ...]

    def tried(self) -> set[str]:
        return {config_key(t.config) for t in self.history}


@dataclass(frozen=True, slots=True)
class Proposal:
    """A candidate: an EngineConfig, or raw values from an agent that the search still has to parse."""

    values: EngineConfig | object  # anything else is parsed (and possibly rejected) by the search
    rationale: str = ""


@dataclass(frozen=True, slots=True)
class ProposalBatch:
    proposals: tuple[Proposal, ...]
    source: str  # proposer name that produced them
    note: str = ""  # e.g. why an agent round fell back to the deterministic proposer


class Proposer(Protocol):
    name: str

    def propose(self, context: SearchContext, num_candidates: int) -> ProposalBatch: ...


class CoordinateProposer:
    """One-knob moves from the incumbent, bottleneck-relevant knobs first; deterministic."""

    name = "coordinate"

    def propose(self, context: SearchContext, num_candidates: int) -> ProposalBatch:
        tried = context.tried()
        order = _BOTTLENECK_KNOBS.get(context.incumbent_metrics.bottleneck, ())
        knobs = [*order, *(k for k in KNOBS if k not in order)]
        # Nearest neighbours of every knob first, then two-step jumps (a plateau can hide a gain), then
        # every other value of each knob: a line search per knob before the search stops.
        proposals: list[Proposal] = []
        for distance in (1, 2, 3):
            for knob in knobs:
                for config in _neighbours(context, knob, distance):
                    key = config_key(config)
                    if key not in tried:
                        tried.add(key)
                        proposals.append(Proposal(config, f"{knob} -> {knob_value(config, knob)!r}"))
                    if len(proposals) >= num_candidates:
                        return ProposalBatch(tuple(proposals), self.name)
        return ProposalBatch(tuple(proposals), self.name)


def _neighbours(context: SearchContext, knob: str, distance: int) -> list[EngineConfig]:
    choices = context.space.choices(knob)
    current = knob_value(context.incumbent, knob)
    if current not in choices:
        return []
    index = choices.index(current)
    if knob == "speculative":  # unordered: every other choice is one move away
        picks = [i for i in range(len(choices)) if i != index] if distance == 1 else []
    elif distance < 3:
        picks = [index + distance, index - distance]
    else:  # the rest of the knob's values, nearest first
        picks = sorted((i for i in range(len(choices)) if abs(i - index) >= 3), key=lambda i: (abs(i - index), i))
    return [with_knob(context.incumbent, knob, choices[i], context.num_gpus) for i in picks if 0 <= i < len(choices)]


_SYSTEM_PROMPT = """You tune sglang engine configurations for one traffic shape.
Reply with one JSON object and nothing else: {"candidates": [{<EngineConfig keys>}, ...], "why": "<one sentence>"}.
EngineConfig keys: tp, dp, max_running_requests, chunked_prefill_size, max_prefill_tokens, schedule_policy,
kv_cache_dtype, quantization, cuda_graph_max_bs, mem_fraction_static, enable_prefix_caching, speculative_algorithm,
speculative_num_steps, speculative_num_draft_tokens. Omitted keys take sglang's defaults. tp * dp must equal num_gpus.
Only values listed in search_space are allowed. Every candidate is checked by deterministic gates before it runs."""


class AgentProposer:
    """Asks an OpenAI-compatible chat endpoint for candidates. A failed or malformed answer falls
    back to the deterministic proposer for that round (and says so), so the search never stalls."""

    name = "agent"

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None, timeout_s: float = 60.0,
                 fallback: Proposer | None = None, max_history: int = 24) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.fallback = fallback or CoordinateProposer()
        self.max_history = max_history

    @classmethod
    def from_environment(cls) -> AgentProposer | None:
        """The agent configured by $POLYMORPH_COMPILER_LLM_URL (and _MODEL, _KEY), or None."""
        url = os.environ.get(LLM_URL_ENV)
        if not url:
            return None
        return cls(url, os.environ.get(LLM_MODEL_ENV, "default"), os.environ.get(LLM_KEY_ENV))

    def propose(self, context: SearchContext, num_candidates: int) -> ProposalBatch:
        try:
            content = self._ask(summarise(context, num_candidates, self.max_history))
            candidates = parse_candidates(content)
        except (OSError, ValueError) as exc:
            batch = self.fallback.propose(context, num_candidates)
            return ProposalBatch(batch.proposals, batch.source, f"agent unavailable ({exc}); {batch.source} proposer used")
        proposals = tuple(Proposal(values, "agent") for values in candidates[:num_candidates])
        return ProposalBatch(proposals, self.name)

    def _ask(self, summary: Mapping[str, object]) -> str:
        body = {"model": self.model, "temperature": 0, "messages": [
            {"role": "system", "content": _SYSTEM_PROMPT},
            {"role": "user", "content": json.dumps(summary, sort_keys=True)},
        ]}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            exc.close()
            raise OSError(f"HTTP {exc.code} from {self.url}") from None
        try:
            return str(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not a chat completion: {str(reply)[:200]}") from exc


def parse_candidates(content: str) -> list[object]:
    """The candidate objects of an agent reply (JSON, optionally inside a ``` fence).
    Raises ValueError when the reply is not the agreed JSON."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", content, re.DOTALL)
    text = fenced.group(1) if fenced else content
    try:
        reply = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"agent reply is not JSON: {exc.msg} at {exc.pos}") from None
    candidates = reply.get("candidates") if isinstance(reply, dict) else None
    if not isinstance(candidates, list):
        raise ValueError("agent reply has no 'candidates' list")
    return list(candidates)  # each still has to parse as an EngineConfig and pass every gate


def summarise(context: SearchContext, num_candidates: int, max_history: int) -> dict[str, object]:
    """What the agent sees: shape, hardware, objective, space, incumbent and the recent trials."""
    def trial(view: TrialView) -> dict[str, object]:
        entry: dict[str, object] = {"config": _changed(view.config)}
        if view.metrics is None:
            entry["rejected"] = view.rejected_reason
        else:
            m = view.metrics
            entry["metrics"] = {"goodput_rps_per_gpu": round(m.goodput_rps_per_gpu, 4), "ttft_p99_s": round(m.ttft_p99_s, 4),
                                "tpot_p99_s": round(m.tpot_p99_s, 4), "kv_usage": round(m.kv_usage, 3), "bottleneck": m.bottleneck}
        return entry

    return {
        "task": f"propose up to {num_candidates} new configurations likely to beat the incumbent",
        "objective": context.objective, "model": context.model.name, "gpu": context.gpu.name, "num_gpus": context.num_gpus,
        "shape": context.shape.to_dict(), "search_space": context.space.to_dict(),
        "incumbent": trial(TrialView(context.incumbent, context.incumbent_metrics)),
        "bottleneck": context.incumbent_metrics.bottleneck,
        "trials": [trial(t) for t in context.history[-max_history:]],
    }


def _changed(config: EngineConfig) -> dict[str, object]:
    """Only the keys that differ from sglang's defaults, to keep the prompt short."""
    default = EngineConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k] or k == "tp"}
