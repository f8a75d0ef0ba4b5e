"""Tier objectives: defaults match the example config; files and flags override them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.tiers import DEFAULT_TIERS, TierSlo, slo_for
from loadtest.slo import load_slos, override_slos
from tests.conftest import REPO


def test_defaults_match_the_example_config() -> None:
    assert load_slos(REPO / "config.example.yaml") == DEFAULT_TIERS


def test_file_and_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text("tiers:\n  interactive: {ttft_p99_s: 0.5}\n  premium: {ttft_p99_s: 0.2, tpot_p99_s: 0.02}\n")
    tier_to_slo = load_slos(path)
    assert tier_to_slo["interactive"] == TierSlo(0.5, 0.05, priority=0, deadline_s=60.0)  # the rest stays the default's
    assert tier_to_slo["premium"] == TierSlo(0.2, 0.02)  # a new tier starts from the standard tier's
    assert override_slos(tier_to_slo, "tpot_p99_s", ["batch=1.5"])["batch"] == TierSlo(60.0, 1.5, priority=2, deadline_s=3600.0)
    assert slo_for(tier_to_slo, "unknown") == DEFAULT_TIERS["standard"]


@pytest.mark.parametrize(
    ("text", "message"),
    [("tiers: 5", r"slo.yaml:1: tiers: expected a `tiers:` mapping"),
     ("tiers:\n  batch: {ttft_p99_s: -1}", r"slo.yaml:2: tiers.batch.ttft_p99_s: must be between 0.001 and 86400"),
     ("tiers:\n  standard: {}\n  batch:\n    ttft_p99_s: soon", r"slo.yaml:4: tiers.batch.ttft_p99_s: must be a number"),
     ("interactive: {ttft_p99_s: 1}\nbatch: 7", r"slo.yaml:2: batch: must be a mapping"),
     ("tiers:\n  batch:\n    ttft_p99: 9", r"slo.yaml:3: tiers.batch.ttft_p99: unknown field")],  # was ignored
)
def test_bad_slo_files_are_clear_errors_with_their_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_slos(path)
    with pytest.raises(ValueError, match="TIER=SECONDS"):
        override_slos(DEFAULT_TIERS, "ttft_p99_s", ["0.5"])
