"""Tier objectives: defaults match the example config; files and flags override them."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.slo import DEFAULT_TIER_SLOS, TierSlo, load_slos, override_slos, slo_for
from tests.conftest import REPO


def test_defaults_match_the_example_config() -> None:
    assert load_slos(REPO / "config.example.yaml") == DEFAULT_TIER_SLOS


def test_file_and_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text("tiers:\n  interactive: {ttft_p99_s: 0.5}\n  premium: {ttft_p99_s: 0.2, tpot_p99_s: 0.02}\n")
    tier_to_slo = load_slos(path)
    assert tier_to_slo["interactive"] == TierSlo(0.5, 0.05)
    assert tier_to_slo["premium"] == TierSlo(0.2, 0.02)
    assert override_slos(tier_to_slo, "tpot_s", ["batch=1.5"])["batch"] == TierSlo(60.0, 1.5)
    assert slo_for(tier_to_slo, "unknown") == DEFAULT_TIER_SLOS["standard"]


@pytest.mark.parametrize(
    ("text", "message"),
    [("tiers: 5", "expected a `tiers:` mapping"), ("tiers:\n  batch: {ttft_p99_s: -1}", "must be > 0"),
     ("tiers:\n  batch: {ttft_p99_s: soon}", "expected seconds")],
)
def test_bad_slo_files_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_slos(path)
    with pytest.raises(ValueError, match="TIER=SECONDS"):
        override_slos(DEFAULT_TIER_SLOS, "ttft_s", ["0.5"])
