"""Raw proxy cost of each peer: peak rate, CPU per request, memory, and added latency at one common rate.

Every peer sits in front of the same fixed-cost nginx backend (non-streaming chat answers). The
peak runs alternate the peers' order round by round (A B C, then C B A) so machine noise falls on
all alike; CPU per request is the peer's process-tree CPU time over a peak run divided by the
requests it served. Added latency is measured at one rate that every peer sustains (half the
slowest peer's peak unless given), paired with the direct run of the same round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench import load, measure, payloads, report
from loadtest.bench.measure import Settings, median_of
from loadtest.bench.peers_stack import StartedPeer, start_peer
from loadtest.bench.processes import Pinning, tree_rss_mb
from loadtest.bench.stack import start_backend
from loadtest.procs import ProcessRegistry

_MIN_RATE_RPS = 10.0


@dataclass(frozen=True, slots=True)
class PeerFigures:
    """One peer's medians over rounds (non-streaming)."""

    name: str
    num_connections: int
    peak_rps: float
    cpu_ms_per_request: float | None
    rss_mb: float | None
    startup_s: float | None
    rate_rps: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    num_errors: int


def run_raw(
    settings: Settings, names: Sequence[str], registry: ProcessRegistry, run_dir: Path, nginx: str,
    pinning: Pinning, name_to_python: Mapping[str, Path], rate_rps: float | None,
    say: Callable[[str], None],
) -> list[PeerFigures]:
    """Start the backend and each peer, measure them side by side, stop nothing (the registry does)."""
    backend = start_backend(registry, run_dir, nginx, pinning)
    started: list[StartedPeer] = []
    for name in names:
        peer = start_peer(name, registry, run_dir, backend.json_port, nginx, pinning, name_to_python)
        started.append(peer)
        if peer.startup_s is not None:
            say(f"  started {name:14s} in {peer.startup_s:6.2f} s")
    targets = [peer.target for peer in started]
    warm_script = load.write_script(run_dir / "peers-warm.lua", payloads.chat_request_body(False), None)
    for target in targets:
        load.run_wrk(settings.wrk, target.json_url, warm_script, max(settings.connections), 1, settings.client_cpus)
    name_to_connections = measure.sweep_connections(settings, targets, "json")
    name_to_cpu_s: dict[str, list[float]] = {}
    name_to_peaks = measure.measure_peaks(settings, targets, "json", name_to_connections, name_to_cpu_s)
    common_rate_rps = rate_rps or common_rate(name_to_peaks)
    say(f"constant-rate latency at {common_rate_rps:.0f} req/s (every peer sustains it)")
    name_to_rate_runs = measure.measure_latency(settings, targets, "json", common_rate_rps)
    name_to_rss_mb = {target.name: tree_rss_mb(target.pid) for target in targets if target.pid is not None}
    figures = report.build_figures("json", name_to_connections, name_to_peaks, name_to_rate_runs)
    name_to_startup_s = {peer.target.name: peer.startup_s for peer in started}
    return [
        _peer_figures(item, name_to_peaks[item.name], name_to_cpu_s.get(item.name), name_to_rss_mb.get(item.name),
                      name_to_startup_s[item.name])
        for item in figures
    ]


def common_rate(name_to_peaks: Mapping[str, Sequence[load.WrkResult]]) -> float:
    """Half the slowest peer's median peak: a load every peer carries without queueing."""
    peaks = [median_of([run.rps for run in runs]) for name, runs in name_to_peaks.items() if name != "direct"]
    return max(_MIN_RATE_RPS, round(min(peaks) / 2) if peaks else _MIN_RATE_RPS)


def _peer_figures(
    item: report.VariantFigures, peaks: Sequence[load.WrkResult], cpu_s: Sequence[float] | None,
    rss_mb: float | None, startup_s: float | None,
) -> PeerFigures:
    cpu_ms = None
    if cpu_s:
        per_run = [1000 * used / max(1, run.num_requests) for used, run in zip(cpu_s, peaks)]
        cpu_ms = median_of(per_run)
    return PeerFigures(
        name=item.name, num_connections=item.num_connections, peak_rps=item.peak_rps, cpu_ms_per_request=cpu_ms,
        rss_mb=rss_mb, startup_s=startup_s, rate_rps=item.rate_rps, p50_ms=item.p50_ms, p99_ms=item.p99_ms,
        added_p50_ms=item.added_p50_ms, added_p99_ms=item.added_p99_ms, num_errors=item.num_errors,
    )

