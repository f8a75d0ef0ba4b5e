"""TrafficShape: the frozen description of a traffic mix the compiler optimises for.

Lengths are equally weighted quantile points (e.g. p10, p30, p50, p70, p90), so a shape built from
a trace and a hand-written one compare the same way. The built-in shapes match the shape rules of
config.example.yaml: `short-chat` (prompts < 4096 tokens), `long-context` (prompts >= 4096),
`reasoning` (math/code, predicted output >= 384) and `batch` (the batch tier, loose SLOs)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kernels.tiers import DEFAULT_TIERS, slo_for

_NUM_QUANTILES = 5
_DEFAULT_TIER = "interactive"  # a shape's tier when none is named: the compiler plans for the tightest


@dataclass(frozen=True, slots=True)
class TrafficShape:
    """A traffic mix and its objectives. Lengths are token counts at equally weighted quantiles."""

    name: str
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    domain_mix: tuple[tuple[str, float], ...] = (("chat", 1.0),)
    prefix_share: float = 0.0  # fraction of prompt tokens a prefix cache can reuse
    arrival_rate_rps: float | None = None  # offered load, when known
    ttft_p99_s: float = DEFAULT_TIERS[_DEFAULT_TIER].ttft_p99_s
    tpot_p99_s: float = DEFAULT_TIERS[_DEFAULT_TIER].tpot_p99_s
    tier: str = _DEFAULT_TIER

    def __post_init__(self) -> None:
        if not self.prompt_tokens or not self.output_tokens:
            raise ValueError(f"shape {self.name!r}: prompt_tokens and output_tokens need at least one point")
        if min(self.prompt_tokens) < 1 or min(self.output_tokens) < 1:
            raise ValueError(f"shape {self.name!r}: token counts must be >= 1")
        if not 0.0 <= self.prefix_share < 1.0:
            raise ValueError(f"shape {self.name!r}: prefix_share must be in [0, 1), got {self.prefix_share}")
        if not self.domain_mix or any(w < 0 for _, w in self.domain_mix) or sum(w for _, w in self.domain_mix) <= 0:
            raise ValueError(f"shape {self.name!r}: domain_mix needs positive weights")
        if not (self.ttft_p99_s > 0 and self.tpot_p99_s > 0):
            raise ValueError(f"shape {self.name!r}: SLOs must be positive")
        if self.arrival_rate_rps is not None and not self.arrival_rate_rps > 0:
            raise ValueError(f"shape {self.name!r}: arrival_rate_rps must be > 0 or None")

    @property
    def mean_prompt_tokens(self) -> float:
        return float(np.mean(self.prompt_tokens))

    @property
    def mean_output_tokens(self) -> float:
        return float(np.mean(self.output_tokens))

    @property
    def max_request_tokens(self) -> int:
        return max(self.prompt_tokens) + max(self.output_tokens)

    def domain_weights(self) -> dict[str, float]:
        total = sum(w for _, w in self.domain_mix)
        return {d: w / total for d, w in self.domain_mix}

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name, "prompt_tokens": list(self.prompt_tokens), "output_tokens": list(self.output_tokens),
            "domain_mix": {d: w for d, w in self.domain_mix}, "prefix_share": self.prefix_share,
            "arrival_rate_rps": self.arrival_rate_rps, "ttft_p99_s": self.ttft_p99_s, "tpot_p99_s": self.tpot_p99_s,
            "tier": self.tier,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> TrafficShape:
        mix = values.get("domain_mix", {"chat": 1.0})
        pairs = mix.items() if isinstance(mix, Mapping) else mix
        return cls(
            name=str(values["name"]),
            prompt_tokens=tuple(int(v) for v in values["prompt_tokens"]),  # type: ignore[attr-defined]
            output_tokens=tuple(int(v) for v in values["output_tokens"]),  # type: ignore[attr-defined]
            domain_mix=_normalise_mix(pairs),
            prefix_share=float(values.get("prefix_share", 0.0)),  # type: ignore[arg-type]
            arrival_rate_rps=None if values.get("arrival_rate_rps") is None else float(values["arrival_rate_rps"]),  # type: ignore[arg-type]
            ttft_p99_s=float(values.get("ttft_p99_s", DEFAULT_TIERS[_DEFAULT_TIER].ttft_p99_s)),  # type: ignore[arg-type]
            tpot_p99_s=float(values.get("tpot_p99_s", DEFAULT_TIERS[_DEFAULT_TIER].tpot_p99_s)),  # type: ignore[arg-type]
            tier=str(values.get("tier", _DEFAULT_TIER)),
        )


def tier_shape(name: str, tier: str) -> TrafficShape:
    """A built-in shape judged by ``tier``'s objectives (the built-ins carry interactive's)."""
    slo = DEFAULT_TIERS[tier]
    return replace(get_shape(name), ttft_p99_s=slo.ttft_p99_s, tpot_p99_s=slo.tpot_p99_s, tier=tier)


def shape_fingerprint(shape: TrafficShape) -> str:
    """Digest of what the compiler optimises for (the name is a label and is left out)."""
    content = shape.to_dict()
    content.pop("name")
    content["domain_mix"] = {d: round(w, 3) for d, w in shape.domain_weights().items()}
    content["prefix_share"] = round(shape.prefix_share, 3)
    rate = shape.arrival_rate_rps
    content["arrival_rate_rps"] = None if rate is None else float(f"{rate:.3g}")
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shape_distance(a: TrafficShape, b: TrafficShape) -> float:
    """How different two shapes are for configuration purposes: log-ratios of the length quantiles
    and SLOs (a 2x longer prompt counts like a 2x tighter TPOT), plus the domain-mix and prefix-share
    differences. 0 for identical shapes."""
    def log_gap(x: Sequence[int] | float, y: Sequence[int] | float) -> float:
        return float(np.mean(np.abs(np.log(np.asarray(_points(x)) / np.asarray(_points(y))))))

    wa, wb = a.domain_weights(), b.domain_weights()
    mix_gap = sum(abs(wa.get(d, 0.0) - wb.get(d, 0.0)) for d in set(wa) | set(wb)) / 2
    return (
        log_gap(a.prompt_tokens, b.prompt_tokens) + log_gap(a.output_tokens, b.output_tokens)
        + 0.5 * (abs(math.log(a.ttft_p99_s / b.ttft_p99_s)) + abs(math.log(a.tpot_p99_s / b.tpot_p99_s)))
        + mix_gap + abs(a.prefix_share - b.prefix_share)
    )


def _points(values: Sequence[int] | float) -> list[float]:
    if isinstance(values, (int, float)):
        return [float(values)]
    # Quantile points of different counts compare at the common quantiles.
    return [float(v) for v in np.quantile(np.asarray(values, dtype=float), np.linspace(0.1, 0.9, _NUM_QUANTILES))]


def shape_from_samples(
    name: str,
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    domains: Sequence[str] = (),
    prefix_share: float = 0.0,
    duration_s: float | None = None,
    tier: str = "interactive",
    slos: tuple[float, float] | None = None,
) -> TrafficShape:
    """Summarise observed requests (a trace or a drift window) as a TrafficShape."""
    if not prompt_tokens or len(prompt_tokens) != len(output_tokens):
        raise ValueError("need equally many (>= 1) prompt and output lengths")
    probs = np.linspace(0.1, 0.9, _NUM_QUANTILES)
    prompts = tuple(max(1, int(round(v))) for v in np.quantile(np.asarray(prompt_tokens, dtype=float), probs))
    outputs = tuple(max(1, int(round(v))) for v in np.quantile(np.asarray(output_tokens, dtype=float), probs))
    counts: dict[str, float] = {}
    for domain in domains or ["chat"]:
        counts[domain] = counts.get(domain, 0.0) + 1.0
    rate = len(prompt_tokens) / duration_s if duration_s and duration_s > 0 else None
    slo = slo_for(DEFAULT_TIERS, tier)
    ttft, tpot = slos or (slo.ttft_p99_s, slo.tpot_p99_s)
    return TrafficShape(name, prompts, outputs, _normalise_mix(counts.items()), prefix_share, rate, ttft, tpot, tier)


def _normalise_mix(pairs: Sequence[tuple[str, float]] | object) -> tuple[tuple[str, float], ...]:
    items = [(str(d), float(w)) for d, w in pairs]  # type: ignore[union-attr]
    total = sum(w for _, w in items)
    if total <= 0:
        raise ValueError("domain_mix needs positive weights")
    return tuple(sorted((d, round(w / total, 4)) for d, w in items))


def _named(name: str, prompts: tuple[int, ...], outputs: tuple[int, ...], mix: dict[str, float], share: float, tier: str) -> TrafficShape:
    slo = DEFAULT_TIERS[tier]
    return TrafficShape(name, prompts, outputs, _normalise_mix(mix.items()), share, None, slo.ttft_p99_s, slo.tpot_p99_s, tier)


# Built-in shapes; their lengths are illustrative quantiles consistent with config.example.yaml's
# rules (short-chat < 4096-token prompts, long-context >= 4096, reasoning outputs >= 384, batch tier).
NAMED_SHAPES: dict[str, TrafficShape] = {
    s.name: s for s in (
        _named("short-chat", (120, 350, 700, 1400, 3000), (60, 150, 250, 400, 700),
               {"chat": 0.8, "code": 0.1, "summarization": 0.1}, 0.3, "interactive"),
        _named("long-context", (4500, 6500, 9000, 14000, 24000), (100, 200, 300, 450, 700),
               {"summarization": 0.5, "chat": 0.3, "code": 0.2}, 0.5, "standard"),
        _named("reasoning", (200, 400, 800, 1500, 3000), (400, 800, 1400, 2400, 4000),
               {"math": 0.5, "code": 0.5}, 0.2, "standard"),
        _named("batch", (300, 800, 1500, 3000, 6000), (100, 250, 500, 900, 1500),
               {"chat": 0.4, "summarization": 0.4, "code": 0.2}, 0.1, "batch"),
    )
}


def get_shape(name_or_shape: str | TrafficShape) -> TrafficShape:
    """A built-in shape by name (or the shape itself). Raises ValueError listing the names."""
    if isinstance(name_or_shape, TrafficShape):
        return name_or_shape
    if name_or_shape not in NAMED_SHAPES:
        raise ValueError(f"unknown traffic shape {name_or_shape!r}; built-in shapes: {', '.join(NAMED_SHAPES)}")
    return NAMED_SHAPES[name_or_shape]


def drifted(shape: TrafficShape, prompt_scale: float = 1.0, output_scale: float = 1.0, name: str | None = None) -> TrafficShape:
    """The shape with its lengths scaled (a drift of the mix), for warm-start tests and benches."""
    return replace(
        shape, name=name or f"{shape.name}~",
        prompt_tokens=tuple(max(1, round(v * prompt_scale)) for v in shape.prompt_tokens),
        output_tokens=tuple(max(1, round(v * output_scale)) for v in shape.output_tokens),
    )
