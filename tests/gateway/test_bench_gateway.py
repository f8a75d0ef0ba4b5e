"""Smoke test of `polymorph bench gateway`: a tiny run end to end, real processes on loopback."""

from __future__ import annotations

import argparse
import sys

import orjson
import pytest

from loadtest.bench import cli
from loadtest.bench.tools import SetupError, ensure_tools


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="polymorph bench")
    cli.register_bench(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["gateway", *argv])


@pytest.mark.slow
def test_tiny_bench_run_prints_one_json_line_and_the_gateway_serves_without_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:  # a fresh machine installs wrk and nginx first: that says so on stderr, not in the bench's table
        ensure_tools(install=True, say=lambda line: print(line, file=sys.stderr))
    except SetupError as problem:
        pytest.skip(f"wrk/nginx unavailable and not installable here: {problem}")
    args = _bench_args(
        ["--duration", "1", "--rounds", "1", "--soak-s", "3", "--connections", "8",
         "--variants", "direct,passthrough,gateway"]
    )

    code = args.handler(args)

    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = orjson.loads(out[-1])
    for key in ("gateway_peak_rps", "passthrough_peak_rps", "direct_peak_rps", "ratio_gateway_vs_passthrough",
                "added_latency_ms", "stream", "soak", "targets", "errors", "rss_mb"):
        assert key in result, key
    assert set(result["added_latency_ms"]) >= {"p50", "p99", "rate_rps"}
    assert result["stream"]["gateway_peak_rps"] > 0
    assert result["gateway_peak_rps"] > 0
    assert result["errors"]["gateway_json"] == 0
    assert result["errors"]["gateway_stream"] == 0
    assert result["soak"]["variant"] == "gateway" and result["soak"]["num_errors"] == 0
    assert out[0].startswith("variant")


def test_connection_list_must_hold_positive_integers() -> None:
    with pytest.raises(SystemExit):
        _bench_args(["--connections", "8,0"])
