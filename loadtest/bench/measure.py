"""The measurement phases: connection sweep, peak rate, constant-rate latency, memory soak.

Rounds alternate the variants' order (A B C D, then D C B A) so that drift in the machine's load
falls on every variant alike; figures are medians over rounds.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.bench import load, payloads
from loadtest.bench.load import WrkResult
from loadtest.bench.processes import tree_cpu_s, tree_rss_mb
from loadtest.bench.stack import Target, describe_answer

MODES = ("json", "stream")


@dataclass(frozen=True, slots=True)
class Settings:
    wrk: str
    duration_s: float
    num_rounds: int
    connections: tuple[int, ...]
    client_cpus: str | None
    script_dir: Path
    say: Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SoakResult:
    variant: str
    duration_s: float
    rss_start_mb: float
    rss_end_mb: float
    slope_mb_per_min: float
    num_requests: int
    num_errors: int


def url_for(target: Target, mode: str) -> str:
    return target.stream_url if mode == "stream" else target.json_url


def round_order(targets: Sequence[Target], round_index: int) -> list[Target]:
    return list(targets) if round_index % 2 == 0 else list(reversed(targets))


def _script(settings: Settings, mode: str, rate_rps: float | None) -> Path:
    suffix = "peak" if rate_rps is None else f"rate{rate_rps:.0f}"
    path = settings.script_dir / f"{mode}-{suffix}.lua"
    return load.write_script(path, payloads.chat_request_body(mode == "stream"), rate_rps)


def warm_up(settings: Settings, targets: Sequence[Target]) -> None:
    """One short run per endpoint: first connections, imports and caches are not measured."""
    for mode in MODES:
        script = _script(settings, mode, None)
        for target in targets:
            load.run_wrk(settings.wrk, url_for(target, mode), script, max(settings.connections), 1, settings.client_cpus)


def sweep_connections(settings: Settings, targets: Sequence[Target], mode: str) -> dict[str, int]:
    """Each variant's best connection count, from short closed-loop runs."""
    script = _script(settings, mode, None)
    sweep_s = max(1.0, settings.duration_s / 2)
    name_to_best: dict[str, int] = {}
    for target in targets:
        url = url_for(target, mode)
        name_to_best[target.name] = max(
            settings.connections,
            key=lambda count: load.run_wrk(settings.wrk, url, script, count, sweep_s, settings.client_cpus).rps,
        )
        settings.say(f"  sweep {mode:6s} {target.name:12s} -> {name_to_best[target.name]} connections")
    return name_to_best


def measure_peaks(
    settings: Settings, targets: Sequence[Target], mode: str, name_to_connections: dict[str, int],
    name_to_cpu_s: dict[str, list[float]] | None = None,
) -> dict[str, list[WrkResult]]:
    """Closed-loop runs in alternating order; ``name_to_cpu_s`` (when given) gets each run's CPU seconds."""
    script = _script(settings, mode, None)
    name_to_runs: dict[str, list[WrkResult]] = {target.name: [] for target in targets}
    for round_index in range(settings.num_rounds):
        for target in round_order(targets, round_index):
            cpu_before_s = tree_cpu_s(target.pid) if target.pid is not None else 0.0
            result = load.run_wrk(
                settings.wrk, url_for(target, mode), script, name_to_connections[target.name],
                settings.duration_s, settings.client_cpus,
            )
            if name_to_cpu_s is not None and target.pid is not None:
                name_to_cpu_s.setdefault(target.name, []).append(tree_cpu_s(target.pid) - cpu_before_s)
            name_to_runs[target.name].append(result)
            settings.say(f"  peak  {mode:6s} {target.name:12s} round {round_index + 1}: {result.rps:9.0f} req/s")
            _say_errors(settings, target, mode, result)
    return name_to_runs


def measure_latency(
    settings: Settings, targets: Sequence[Target], mode: str, rate_rps: float
) -> dict[str, list[WrkResult]]:
    """Open-loop runs at ``rate_rps`` for every variant, in alternating order."""
    script = _script(settings, mode, rate_rps)
    num_connections = load.connections_for_rate(rate_rps)
    name_to_runs: dict[str, list[WrkResult]] = {target.name: [] for target in targets}
    for round_index in range(settings.num_rounds):
        for target in round_order(targets, round_index):
            result = load.run_wrk(
                settings.wrk, url_for(target, mode), script, num_connections, settings.duration_s,
                settings.client_cpus,
            )
            name_to_runs[target.name].append(result)
            settings.say(
                f"  rate  {mode:6s} {target.name:12s} round {round_index + 1}: {result.rps:7.0f} req/s "
                f"p50 {result.p50_ms:.3f} ms p99 {result.p99_ms:.3f} ms"
            )
            _say_errors(settings, target, mode, result)
    return name_to_runs


def _say_errors(settings: Settings, target: Target, mode: str, result: WrkResult) -> None:
    if result.num_errors:
        answer = describe_answer(url_for(target, mode), mode == "stream")
        settings.say(
            f"    {result.num_bad_status} bad statuses, {result.num_socket_errors} socket errors; "
            f"a request now gets {answer}"
        )


def soak(settings: Settings, target: Target, num_connections: int, soak_s: float) -> SoakResult:
    """Closed-loop load for ``soak_s`` while sampling the target's memory every few seconds."""
    if target.pid is None:
        raise ValueError("the soak needs a variant with a process to watch")
    script = _script(settings, "json", None)
    argv = load.wrk_argv(settings.wrk, target.json_url, script, num_connections, soak_s, settings.client_cpus)
    sample_every_s = min(5.0, max(0.5, soak_s / 20))
    started_at = time.monotonic()
    times_s = [0.0]
    rss_mb = [tree_rss_mb(target.pid)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as wrk:
        while wrk.poll() is None:
            time.sleep(sample_every_s)
            times_s.append(time.monotonic() - started_at)
            rss_mb.append(tree_rss_mb(target.pid))
        stdout, stderr = wrk.communicate()
    result = load.parse_wrk_output(stdout, stderr)
    return SoakResult(
        variant=target.name,
        duration_s=times_s[-1],
        rss_start_mb=rss_mb[0],
        rss_end_mb=rss_mb[-1],
        slope_mb_per_min=slope_per_min(times_s, rss_mb),
        num_requests=result.num_requests,
        num_errors=result.num_errors,
    )


def slope_per_min(times_s: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` per minute; 0 with fewer than two samples."""
    if len(times_s) < 2:
        return 0.0
    slope_per_s = np.polyfit(np.asarray(times_s, dtype=float), np.asarray(values, dtype=float), 1)[0]
    return float(slope_per_s * 60)


def median_of(values: Sequence[float]) -> float:
    return float(statistics.median(values))
