"""`polymorph bench peers` output: the raw-cost table, the routing table, and the JSON with ratios to Polymorph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from loadtest.bench.peers_raw import PeerFigures

REFERENCE = "polymorph"
# The targets, measured in the same run.
MIN_PEAK_RATIO_VS_SGLANG_ROUTER = 0.5
MIN_PEAK_RATIO_VS_LITELLM = 30.0
MAX_ADDED_P50_GAP_VS_SGLANG_ROUTER_MS = 0.5
MIN_GOODPUT_RATIO_VS_CACHE_AWARE = 1.3


def format_raw_table(figures: Sequence[PeerFigures]) -> str:
    reference = _by_name(figures).get(REFERENCE)
    header = (
        f"{'peer':14s} {'conns':>5s} {'peak req/s':>10s} {'pm/peer':>7s} {'CPU ms/req':>10s} {'RSS MB':>7s} "
        f"{'start s':>7s} {'rate':>6s} {'p50 ms':>7s} {'p99 ms':>7s} {'+p50 ms':>7s} {'+p99 ms':>7s} {'errors':>6s}"
    )
    lines = [header, "-" * len(header)]
    for item in figures:
        ratio = reference.peak_rps / item.peak_rps if reference is not None and item.peak_rps > 0 else None
        lines.append(
            f"{item.name:14s} {item.num_connections:5d} {item.peak_rps:10.0f} {_cell(ratio, 7, 2)} "
            f"{_cell(item.cpu_ms_per_request, 10, 3)} {_cell(item.rss_mb, 7, 1)} {_cell(item.startup_s, 7, 2)} "
            f"{item.rate_rps:6.0f} {item.p50_ms:7.3f} {item.p99_ms:7.3f} {_cell(item.added_p50_ms, 7, 3)} "
            f"{_cell(item.added_p99_ms, 7, 3)} {item.num_errors:6d}"
        )
    lines.append("pm/peer: Polymorph's peak divided by the peer's; +p50/+p99: minus direct, same round, same rate")
    return "\n".join(lines)


def raw_summary(figures: Sequence[PeerFigures]) -> dict[str, object]:
    """Per peer figures plus ``polymorph_vs_<peer>`` ratios of peak rate, CPU, memory and added p50."""
    name_to_item = _by_name(figures)
    peers: dict[str, object] = {name: _rounded(asdict(item)) for name, item in name_to_item.items()}
    reference = name_to_item.get(REFERENCE)
    ratios: dict[str, object] = {}
    if reference is not None:
        for name, item in name_to_item.items():
            if name == REFERENCE:
                continue
            ratios[name] = {
                "peak_rps": _ratio(reference.peak_rps, item.peak_rps),
                "cpu_ms_per_request": _ratio(reference.cpu_ms_per_request, item.cpu_ms_per_request),
                "rss_mb": _ratio(reference.rss_mb, item.rss_mb),
                "added_p50_gap_ms": _gap(reference.added_p50_ms, item.added_p50_ms),
            }
    return {"peers": peers, "polymorph_vs": ratios, "rate_rps": round(figures[0].rate_rps, 1) if figures else None}


def raw_targets(figures: Sequence[PeerFigures]) -> dict[str, bool | None]:
    name_to_item = _by_name(figures)
    pm, router, litellm = (name_to_item.get(name) for name in (REFERENCE, "sglang-router", "litellm"))
    gap = _gap(pm.added_p50_ms if pm else None, router.added_p50_ms if router else None)
    return {
        f"peak_ge_{MIN_PEAK_RATIO_VS_SGLANG_ROUTER}x_sglang_router": _at_least(
            _ratio(pm.peak_rps if pm else None, router.peak_rps if router else None), MIN_PEAK_RATIO_VS_SGLANG_ROUTER
        ),
        f"peak_ge_{MIN_PEAK_RATIO_VS_LITELLM:.0f}x_litellm": _at_least(
            _ratio(pm.peak_rps if pm else None, litellm.peak_rps if litellm else None), MIN_PEAK_RATIO_VS_LITELLM
        ),
        f"added_p50_within_{MAX_ADDED_P50_GAP_VS_SGLANG_ROUTER_MS}ms_of_sglang_router": (
            None if gap is None else gap <= MAX_ADDED_P50_GAP_VS_SGLANG_ROUTER_MS
        ),
    }


def _by_name(figures: Sequence[PeerFigures]) -> dict[str, PeerFigures]:
    return {item.name: item for item in figures}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def _gap(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None else round(ours - theirs, 3)


def _at_least(value: float | None, floor: float) -> bool | None:
    return None if value is None else value >= floor


def _rounded(fields: dict[str, object]) -> dict[str, object]:
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in fields.items()}


def _cell(value: float | None, width: int, decimals: int) -> str:
    return f"{value:{width}.{decimals}f}" if value is not None else f"{'-':>{width}s}"
