"""`polymorph bench gateway`: start the stack, run every phase, print the table and the JSON line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import orjson

from loadtest.bench import measure, report
from loadtest.bench.measure import Settings, SoakResult
from loadtest.bench.processes import Pinning, default_pinning, tree_rss_mb
from loadtest.bench.report import VariantFigures
from loadtest.bench.stack import VARIANTS, Target, start_backend, start_target
from loadtest.bench.tools import SetupError, ensure_tools
from loadtest.procs import ProcessRegistry


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main_bench(args: argparse.Namespace) -> int:
    try:
        tool_to_path = ensure_tools(install=not args.no_install, say=_say)
        variants = parse_variants(args.variants)
    except (SetupError, ValueError) as problem:
        _say(f"bench gateway: {problem}")
        return 2
    pinning = default_pinning(pin=not args.no_pin)
    _say(f"bench gateway: variants {', '.join(variants)}; {pinning.describe()}; load average {_loadavg():.2f}")
    with _sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="polymorph-bench-") as tmp:
        run_dir = Path(tmp)
        with ProcessRegistry(run_dir) as registry:
            try:
                result = _run(args, variants, tool_to_path, pinning, registry, run_dir)
            except RuntimeError as problem:
                _say(f"bench gateway: {problem}")
                for name in ("gateway-json", "gateway-stream", "passthrough-json", "backend-nginx"):
                    if tail := registry.log_tail(name):
                        _say(f"--- {name} log (tail) ---\n{tail}")
                return 1
    if not args.json_only:
        print(result.pop("_table"))
    else:
        result.pop("_table")
    print(orjson.dumps(result).decode(), flush=True)
    return 0


def parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        raise ValueError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    # Canonical order keeps the A/B alternation and the table stable whatever order was typed.
    return tuple(name for name in VARIANTS if name in names)


def _run(
    args: argparse.Namespace, variants: Sequence[str], tool_to_path: dict[str, str], pinning: Pinning,
    registry: ProcessRegistry, run_dir: Path,
) -> dict[str, object]:
    loadavg_at_start = _loadavg()
    backend = start_backend(registry, run_dir, tool_to_path["nginx"], pinning)
    targets = [
        start_target(name, registry, run_dir, backend, tool_to_path["nginx"], pinning, args.gateway_arg)
        for name in variants
    ]
    settings = Settings(
        wrk=tool_to_path["wrk"], duration_s=args.duration, num_rounds=args.rounds,
        connections=tuple(args.connections), client_cpus=pinning.client_cpus, script_dir=run_dir, say=_say,
    )
    _say("warming up")
    measure.warm_up(settings, targets)
    name_to_rss_start = {target.name: tree_rss_mb(target.pid) for target in targets if target.pid is not None}
    figures: list[VariantFigures] = []
    name_to_json_connections: dict[str, int] = {}
    for mode in measure.MODES:
        name_to_connections = measure.sweep_connections(settings, targets, mode)
        name_to_peaks = measure.measure_peaks(settings, targets, mode, name_to_connections)
        rate_rps = _latency_rate(name_to_peaks)
        _say(f"constant-rate latency ({mode}) at {rate_rps:.0f} req/s")
        name_to_rate_runs = measure.measure_latency(settings, targets, mode, rate_rps)
        figures.extend(report.build_figures(mode, name_to_connections, name_to_peaks, name_to_rate_runs))
        if mode == "json":
            name_to_json_connections = name_to_connections
    name_to_rss_end = {target.name: tree_rss_mb(target.pid) for target in targets if target.pid is not None}
    soak = _soak(settings, targets, name_to_json_connections, args.soak_s)
    return _result(args, figures, soak, pinning, loadavg_at_start, name_to_rss_start, name_to_rss_end)


def _latency_rate(name_to_peaks: dict[str, list]) -> float:  # type: ignore[type-arg]
    """Half the gateway's peak (the issue's operating point); else half the slowest variant's."""
    name_to_peak = {name: measure.median_of([run.rps for run in runs]) for name, runs in name_to_peaks.items()}
    reference = name_to_peak.get("gateway", min(name_to_peak.values()))
    return max(10.0, reference / 2)


def _soak(
    settings: Settings, targets: Sequence[Target], name_to_connections: dict[str, int], soak_s: float
) -> SoakResult | None:
    """Soak the gateway (the pass-through stands in when the gateway is not measured)."""
    name_to_target = {target.name: target for target in targets}
    target = name_to_target.get("gateway") or name_to_target.get("passthrough")
    if soak_s <= 0 or target is None:
        return None
    _say(f"memory soak of {target.name} for {soak_s:.0f} s")
    return measure.soak(settings, target, name_to_connections[target.name], soak_s)


def _result(
    args: argparse.Namespace, figures: list[VariantFigures], soak: SoakResult | None, pinning: Pinning,
    loadavg_at_start: float, name_to_rss_start: dict[str, float], name_to_rss_end: dict[str, float],
) -> dict[str, object]:
    result = report.mode_summary(figures, "json")
    result["stream"] = report.mode_summary(figures, "stream")
    result["rss_mb"] = {
        name: {"start": round(name_to_rss_start[name], 1), "end": round(name_to_rss_end[name], 1)}
        for name in name_to_rss_start
    }
    result["soak"] = report.soak_summary(soak)
    result["targets"] = report.target_checks(figures, soak)
    result["errors"] = {f"{item.name}_{item.mode}": item.num_errors for item in figures}
    result["settings"] = {
        "duration_s": args.duration, "rounds": args.rounds, "connections": list(args.connections),
        "pinning": pinning.describe(), "num_cpus": os.cpu_count(), "gateway_args": list(args.gateway_arg),
        "loadavg_1m_at_start": round(loadavg_at_start, 2), "loadavg_1m_at_end": round(_loadavg(), 2),
    }
    lines = [report.format_table(figures)]
    if soak is not None:
        lines.append(
            f"soak {soak.variant}: {soak.duration_s:.0f} s, RSS {soak.rss_start_mb:.1f} -> {soak.rss_end_mb:.1f} MB, "
            f"slope {soak.slope_mb_per_min:+.3f} MB/min, {soak.num_requests} requests, {soak.num_errors} errors"
        )
    lines.append(f"pinning: {pinning.describe()}; load average {loadavg_at_start:.2f} -> {_loadavg():.2f}")
    result["_table"] = "\n".join(lines)
    return result


def _loadavg() -> float:
    return os.getloadavg()[0]


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so that every child is still ended by the registry."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
