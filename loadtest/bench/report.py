"""Turn the runs into per-variant figures, the human table and the one JSON line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from loadtest.bench.load import WrkResult
from loadtest.bench.measure import SoakResult, median_of

# The targets for one gateway process on the 2-core machine.
MIN_PEAK_RPS = 5000.0
MIN_RATIO_VS_PASSTHROUGH = 0.7
MAX_ADDED_P50_MS = 0.5
MAX_ADDED_P99_MS = 2.0
MAX_SOAK_SLOPE_MB_PER_MIN = 1.0


@dataclass(frozen=True, slots=True)
class VariantFigures:
    """One variant in one mode (json or stream): medians over rounds."""

    name: str
    mode: str
    num_connections: int
    peak_rps: float
    rate_rps: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    num_errors: int


def build_figures(
    mode: str,
    name_to_connections: dict[str, int],
    name_to_peaks: dict[str, list[WrkResult]],
    name_to_rate_runs: dict[str, list[WrkResult]],
) -> list[VariantFigures]:
    """Added latency pairs each variant with direct in the same round, then takes the median."""
    direct_runs = name_to_rate_runs.get("direct")
    figures = []
    for name, peaks in name_to_peaks.items():
        rate_runs = name_to_rate_runs[name]
        added_p50 = added_p99 = None
        if direct_runs is not None and name != "direct":
            added_p50 = median_of([run.p50_ms - base.p50_ms for run, base in zip(rate_runs, direct_runs)])
            added_p99 = median_of([run.p99_ms - base.p99_ms for run, base in zip(rate_runs, direct_runs)])
        figures.append(
            VariantFigures(
                name=name,
                mode=mode,
                num_connections=name_to_connections[name],
                peak_rps=median_of([run.rps for run in peaks]),
                rate_rps=median_of([run.rps for run in rate_runs]),
                p50_ms=median_of([run.p50_ms for run in rate_runs]),
                p99_ms=median_of([run.p99_ms for run in rate_runs]),
                added_p50_ms=added_p50,
                added_p99_ms=added_p99,
                num_errors=sum(run.num_errors for run in [*peaks, *rate_runs]),
            )
        )
    return figures


def format_table(figures: Sequence[VariantFigures]) -> str:
    name_mode_to_peak = {(item.name, item.mode): item.peak_rps for item in figures}
    header = (
        f"{'variant':12s} {'mode':6s} {'conns':>5s} {'peak req/s':>10s} {'vs pass':>7s} {'rate req/s':>10s} "
        f"{'p50 ms':>7s} {'p99 ms':>7s} {'+p50 ms':>7s} {'+p99 ms':>7s} {'errors':>6s}"
    )
    lines = [header, "-" * len(header)]
    for item in figures:
        passthrough_rps = name_mode_to_peak.get(("passthrough", item.mode))
        ratio = f"{item.peak_rps / passthrough_rps:7.2f}" if passthrough_rps else f"{'-':>7s}"
        lines.append(
            f"{item.name:12s} {item.mode:6s} {item.num_connections:5d} {item.peak_rps:10.0f} {ratio} "
            f"{item.rate_rps:10.0f} {item.p50_ms:7.3f} {item.p99_ms:7.3f} {_cell(item.added_p50_ms)} "
            f"{_cell(item.added_p99_ms)} {item.num_errors:6d}"
        )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{value:7.3f}" if value is not None else f"{'-':>7s}"


def mode_summary(figures: Sequence[VariantFigures], mode: str) -> dict[str, object]:
    """Peak rates, ratios and added latency of one mode, keyed as the JSON line names them."""
    name_to_item = {item.name: item for item in figures if item.mode == mode}
    summary: dict[str, object] = {
        f"{name}_peak_rps": round(item.peak_rps, 1) for name, item in name_to_item.items()
    }
    gateway = name_to_item.get("gateway")
    for reference in ("passthrough", "nginx", "direct"):
        if gateway is not None and reference in name_to_item and name_to_item[reference].peak_rps > 0:
            summary[f"ratio_gateway_vs_{reference}"] = round(gateway.peak_rps / name_to_item[reference].peak_rps, 3)
    rate_rps = next(iter(name_to_item.values())).rate_rps if name_to_item else 0.0
    added: dict[str, object] = {"rate_rps": round(rate_rps, 1)}
    for name, item in name_to_item.items():
        if item.added_p50_ms is None or item.added_p99_ms is None:
            continue
        pair = {"p50": round(item.added_p50_ms, 3), "p99": round(item.added_p99_ms, 3)}
        if name == "gateway":
            added.update(pair)
        else:
            added[name] = pair
    summary["added_latency_ms"] = added
    return summary


def target_checks(figures: Sequence[VariantFigures], soak: SoakResult | None) -> dict[str, bool | None]:
    """The issue's targets (non-streaming), each True/False, or None when its figure is missing."""
    name_to_item = {item.name: item for item in figures if item.mode == "json"}
    gateway = name_to_item.get("gateway")
    passthrough = name_to_item.get("passthrough")
    if gateway is None:
        ratio = None
    else:
        ratio = gateway.peak_rps / passthrough.peak_rps if passthrough and passthrough.peak_rps > 0 else None
    soak_slope = soak.slope_mb_per_min if soak is not None and soak.variant == "gateway" else None
    return {
        f"peak_rps_ge_{MIN_PEAK_RPS:.0f}": _at_least(gateway.peak_rps if gateway else None, MIN_PEAK_RPS),
        f"ratio_vs_passthrough_ge_{MIN_RATIO_VS_PASSTHROUGH}": _at_least(ratio, MIN_RATIO_VS_PASSTHROUGH),
        f"added_p50_le_{MAX_ADDED_P50_MS}ms": _at_most(gateway.added_p50_ms if gateway else None, MAX_ADDED_P50_MS),
        f"added_p99_le_{MAX_ADDED_P99_MS}ms": _at_most(gateway.added_p99_ms if gateway else None, MAX_ADDED_P99_MS),
        f"soak_slope_le_{MAX_SOAK_SLOPE_MB_PER_MIN}mb_per_min": _at_most(soak_slope, MAX_SOAK_SLOPE_MB_PER_MIN),
    }


def _at_least(value: float | None, floor: float) -> bool | None:
    return None if value is None else value >= floor


def _at_most(value: float | None, ceiling: float) -> bool | None:
    return None if value is None else value <= ceiling


def soak_summary(soak: SoakResult | None) -> dict[str, object] | None:
    if soak is None:
        return None
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in asdict(soak).items()}
