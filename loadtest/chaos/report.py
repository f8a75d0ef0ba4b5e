"""Scenario results: the figures every scenario reports, its pass/fail checks, the table and the JSON line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadtest.chaos.load import CLEAR, LOST, OK, Answer


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    name: str
    sent: int
    succeeded: int
    retried: int
    failed_clear: int
    lost: int
    max_added_latency_ms: float
    checks: tuple[Check, ...] = ()
    figures: Mapping[str, float] = field(default_factory=dict)  # scenario-specific: readmitted_after_s, rss_mb, ...
    lost_reasons: tuple[str, ...] = ()
    skipped: str | None = None  # why the scenario could not run here

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.lost == 0 and all(c.passed for c in self.checks)

    def failures(self) -> list[str]:
        found = [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]
        if self.lost:
            found.append(f"{self.lost} lost ({'; '.join(sorted(set(self.lost_reasons))[:3])})")
        return found

    def to_json(self) -> dict[str, object]:
        return {
            "sent": self.sent, "succeeded": self.succeeded, "retried": self.retried, "failed_clear": self.failed_clear,
            "lost": self.lost, "max_added_latency_ms": round(self.max_added_latency_ms, 1),
            "passed": self.passed, "skipped": self.skipped, "failures": self.failures(),
            **{k: round(v, 3) for k, v in self.figures.items()},
        }


def summarize(name: str, answers: Sequence[Answer], retried: float, baseline_s: float, checks: Sequence[Check] = (),
              figures: Mapping[str, float] | None = None) -> ScenarioResult:
    """Count the answers; added latency is the slowest answer (success or clear failure) over the baseline median."""
    answered = [a.latency_s for a in answers if a.verdict != LOST]
    return ScenarioResult(
        name=name,
        sent=len(answers),
        succeeded=sum(a.verdict == OK for a in answers),
        retried=int(retried),
        failed_clear=sum(a.verdict == CLEAR for a in answers),
        lost=sum(a.verdict == LOST for a in answers),
        max_added_latency_ms=max(0.0, (max(answered, default=baseline_s) - baseline_s) * 1000),
        checks=tuple(checks),
        figures=dict(figures or {}),
        lost_reasons=tuple(a.detail for a in answers if a.verdict == LOST),
    )


def skipped(name: str, reason: str) -> ScenarioResult:
    return ScenarioResult(name, 0, 0, 0, 0, 0, 0.0, skipped=reason)


def render_table(results: Sequence[ScenarioResult]) -> str:
    header = f"{'scenario':<26} {'sent':>6} {'ok':>6} {'retried':>7} {'clear':>6} {'lost':>5} {'+lat ms':>8}  result"
    lines = [header, "-" * len(header)]
    for r in results:
        verdict = f"skipped: {r.skipped}" if r.skipped else ("pass" if r.passed else "FAIL: " + "; ".join(r.failures()))
        lines.append(f"{r.name:<26} {r.sent:>6} {r.succeeded:>6} {r.retried:>7} {r.failed_clear:>6} {r.lost:>5} "
                     f"{r.max_added_latency_ms:>8.0f}  {verdict}")
        if r.figures:
            lines.append(" " * 27 + ", ".join(f"{k}={v:g}" for k, v in r.figures.items()))
    return "\n".join(lines)


def json_summary(results: Sequence[ScenarioResult], pending: Sequence[str]) -> dict[str, object]:
    ran = [r for r in results if r.skipped is None]
    return {
        "bench": "chaos",
        "passed": all(r.passed for r in ran),
        "lost_total": sum(r.lost for r in ran),
        "scenarios": {r.name: r.to_json() for r in results},
        "pending": list(pending),
    }
