"""`polymorph bench dashboard`'s arithmetic: alternating order, added latency over direct, the ratios."""

from __future__ import annotations

from loadtest.bench.dashboard_cost import RUNS, Round, run_order, summarize
from loadtest.bench.load import WrkResult


def _wrk(p50_ms: float, p99_ms: float, errors: int = 0) -> WrkResult:
    return WrkResult(num_requests=5000, duration_s=10.0, num_socket_errors=errors, num_bad_status=0, p50_ms=p50_ms, p99_ms=p99_ms)


def test_rounds_alternate_so_machine_drift_falls_on_every_run_alike() -> None:
    assert run_order(0) == RUNS and run_order(1) == tuple(reversed(RUNS)) and run_order(2) == RUNS


def test_added_latency_is_gateway_minus_direct_of_the_same_round_and_ratios_compare_medians() -> None:
    rounds = [
        Round(direct=_wrk(0.1, 1.0), gateway=_wrk(1.1, 6.0), dashboard=_wrk(1.2, 7.0)),
        Round(direct=_wrk(0.3, 3.0), gateway=_wrk(1.3, 8.0), dashboard=_wrk(1.3, 8.0, errors=2)),
        Round(direct=_wrk(0.2, 2.0), gateway=_wrk(1.2, 7.0), dashboard=_wrk(1.4, 9.0)),
    ]
    summary = summarize(rounds, 500.0, [4.0, 6.0, 5.0], {})
    assert summary["added_latency_ms"] == {"without_dashboard": {"p50": 1.0, "p99": 5.0}, "with_dashboard": {"p50": 1.1, "p99": 6.0}}
    assert summary["ratio_p50"] == 1.1 and summary["ratio_p99"] == 1.2
    assert summary["dashboard_poll_ms"] == {"count": 3, "p50": 5.0, "max": 6.0}
    assert summary["errors"] == 2
