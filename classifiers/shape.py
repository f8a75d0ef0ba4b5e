"""What the router needs to know about one request, and the config rules that name its shape.

``Shape`` is built once per request on the hot path and read by the router, the proxy and the
metrics; ``ShapeRule`` is built once at config load. Both are frozen so a decision that holds a
shape can never be changed behind its back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.domains import DOMAINS

__all__ = ["DOMAINS", "Shape", "ShapeRule", "ShapeRules", "default_shape_rules"]


@dataclass(slots=True)
class Shape:
    """One request's classification: its features, predictions and the shape name they select.

    Treat it as read-only. It is not ``frozen``: a frozen dataclass sets each field through
    ``object.__setattr__``, which doubled the cost of building one on every request.
    """

    name: str
    domain: str
    domain_confidence: float
    prompt_tokens: int
    predicted_output_p50: int
    predicted_output_p90: int
    tier: str
    tenant: str
    prefix_fp: int  # stable hash of the system prompt / leading prefix; 0 when there is none
    max_tokens: int | None
    stream: bool
    num_messages: int = 0
    has_tools: bool = False
    json_mode: bool = False


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """A named shape: every condition that is set must hold (absent conditions match anything)."""

    name: str
    tiers: frozenset[str] | None = None
    domains: frozenset[str] | None = None
    tenants: frozenset[str] | None = None
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_predicted_output: int | None = None
    max_predicted_output: int | None = None

    def matches(self, tier: str, domain: str, tenant: str, prompt_tokens: int, predicted_output: int) -> bool:
        if self.tiers is not None and tier not in self.tiers:
            return False
        if self.domains is not None and domain not in self.domains:
            return False
        if self.tenants is not None and tenant not in self.tenants:
            return False
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        if self.min_predicted_output is not None and predicted_output < self.min_predicted_output:
            return False
        if self.max_predicted_output is not None and predicted_output > self.max_predicted_output:  # noqa: SIM103 (one guard per condition)
            return False
        return True


@dataclass(frozen=True, slots=True)
class ShapeRules:
    """Ordered rules with a default: the first rule that matches names the shape."""

    rules: tuple[ShapeRule, ...]
    default: str

    @property
    def names(self) -> tuple[str, ...]:
        seen = [rule.name for rule in self.rules]
        return tuple(dict.fromkeys([*seen, self.default]))

    def select(self, tier: str, domain: str, tenant: str, prompt_tokens: int, predicted_output: int) -> str:
        for rule in self.rules:
            if rule.matches(tier, domain, tenant, prompt_tokens, predicted_output):
                return rule.name
        return self.default


def default_shape_rules() -> ShapeRules:
    """The shapes of ``config.example.yaml``, used when a config declares none."""
    return ShapeRules(
        rules=(
            ShapeRule("batch", tiers=frozenset({"batch"})),
            ShapeRule("long-context", min_prompt_tokens=4096),
            ShapeRule("reasoning", domains=frozenset({"math", "code"}), min_predicted_output=384),
            ShapeRule("short-chat", max_prompt_tokens=4095),
        ),
        default="short-chat",
    )

