"""Token-length distributions: mixtures of lognormals fitted to public traces, or given inline.

The fitted numbers live in ``data/fitted.json`` (written by ``scripts/fit_lengths.py`` from the
Azure 2023 and ServeGen traces; provenance is in the file and in README.md). A profile such as
``azure-conv`` holds an input and an output distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class LogComponent:
    weight: float
    mu: float  # mean of ln(tokens)
    sigma: float  # standard deviation of ln(tokens)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A mixture of lognormals over token counts, rounded and clipped to [min_tokens, max_tokens]."""

    components: tuple[LogComponent, ...]
    min_tokens: int = 1
    max_tokens: int = 131_072

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        weights = np.array([component.weight for component in self.components])
        picks = rng.choice(len(self.components), size=size, p=weights / weights.sum())
        mus = np.array([component.mu for component in self.components])[picks]
        sigmas = np.array([component.sigma for component in self.components])[picks]
        tokens = np.rint(np.exp(rng.normal(mus, sigmas)))
        return np.clip(tokens, self.min_tokens, self.max_tokens).astype(np.int64)


def fixed(tokens: int) -> LengthDist:
    """Every draw is ``tokens``."""
    return LengthDist((LogComponent(1.0, math.log(tokens), 0.0),), tokens, tokens)


def lognormal(median: float, sigma: float, min_tokens: int = 1, max_tokens: int = 131_072) -> LengthDist:
    return LengthDist((LogComponent(1.0, math.log(median), sigma),), min_tokens, max_tokens)


@cache
def fitted_data() -> dict[str, Any]:
    """The shipped fit results (lengths and arrival shapes), as stored."""
    text = resources.files("loadtest").joinpath("data/fitted.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


def profile_names() -> tuple[str, ...]:
    return tuple(fitted_data()["lengths"])


def profile(name: str, kind: str) -> LengthDist:
    """The fitted ``kind`` ("input" or "output") distribution of profile ``name``."""
    profiles = fitted_data()["lengths"]
    if name not in profiles:
        raise ValueError(f"unknown length profile {name!r}; built-in profiles: {', '.join(profiles)}")
    if kind not in ("input", "output"):
        raise ValueError(f"length kind must be input or output, got {kind!r}")
    fit = profiles[name][kind]
    components = tuple(LogComponent(c["weight"], c["mu"], c["sigma"]) for c in fit["components"])
    return LengthDist(components, int(fit["min"]), int(fit["max"]))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_length(value: object, kind: str) -> LengthDist:
    """A length from a scenario: a profile name, an integer, or {lognormal: {median, sigma}, min, max}."""
    if isinstance(value, bool):
        raise ValueError(f"{kind} length must be a profile name, an integer or a mapping, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{kind} length must be >= 1 token, got {value}")
        return fixed(value)
    if isinstance(value, str):
        return profile(value, kind)
    if isinstance(value, dict) and isinstance(value.get("lognormal"), dict):
        params = value["lognormal"]
        unknown = sorted(str(key) for key in (*set(value) - {"lognormal", "min", "max"}, *set(params) - {"median", "sigma"}))
        if unknown:  # a misspelt `mx` would leave the 131,072-token default in force
            raise ValueError(f"{kind}: unknown keys {unknown} in {{lognormal: {{median, sigma}}, min, max}}")
        median, sigma = params.get("median"), params.get("sigma")
        if not (_is_number(median) and _is_number(sigma)):
            raise ValueError(f"{kind}: lognormal needs numeric median and sigma, got {params!r}")
        if median < 1 or sigma < 0:
            raise ValueError(f"{kind}: lognormal median must be >= 1 and sigma >= 0, got {params!r}")
        low, high = value.get("min", 1), value.get("max", 131_072)
        if not all(isinstance(bound, int) and not isinstance(bound, bool) and bound >= 1 for bound in (low, high)) or low > high:
            raise ValueError(f"{kind}: min and max must be whole token counts >= 1 with min <= max, got min {low!r}, max {high!r}")
        return lognormal(float(median), float(sigma), low, high)
    raise ValueError(
        f"{kind} length must be a profile name ({', '.join(profile_names())}), an integer, "
        f"or {{lognormal: {{median: M, sigma: S}}, min: A, max: B}}; got {value!r}"
    )
