"""Fitted length distributions: shipped, reproducible, and close to the traces they came from."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.lengths import fitted_data, parse_length, profile, profile_names


def test_every_profile_samples_within_its_range_and_near_its_fitted_quantiles() -> None:
    assert set(profile_names()) >= {"azure-code", "azure-conv", "servegen-m-large", "servegen-deepseek-r1"}
    for name in profile_names():
        for kind in ("input", "output"):
            dist = profile(name, kind)
            draws = dist.sample(np.random.default_rng(20231116), 100_000)
            stored = fitted_data()["lengths"][name][kind]
            assert draws.min() >= stored["min"] and draws.max() <= stored["max"]
            assert np.quantile(draws, 0.5) == pytest.approx(stored["fitted"]["p50"], rel=0.05)


def test_fitted_medians_match_the_traces_within_ten_percent() -> None:
    for name in profile_names():
        for kind in ("input", "output"):
            fit = fitted_data()["lengths"][name][kind]
            assert fit["fitted"]["p50"] == pytest.approx(fit["empirical"]["p50"], rel=0.1), (name, kind)


def test_arrival_shapes_are_stored_with_sources() -> None:
    shapes = fitted_data()["arrivals"]
    assert shapes["azure-code"]["iat_cv"] == pytest.approx(13.15, abs=0.01)
    assert shapes["azure-conv"]["rate_rps"] == pytest.approx(5.53, abs=0.01)
    assert all("Azure" in shape["source"] for shape in shapes.values())


def test_parse_length_forms_and_errors() -> None:
    rng = np.random.default_rng(0)
    assert set(parse_length(128, "input").sample(rng, 5).tolist()) == {128}
    lognormal = parse_length({"lognormal": {"median": 1000, "sigma": 0.5}, "min": 200, "max": 4000}, "input")
    draws = lognormal.sample(rng, 20_000)
    assert draws.min() >= 200 and draws.max() <= 4000
    assert np.median(draws) == pytest.approx(1000, rel=0.05)
    with pytest.raises(ValueError, match="unknown length profile 'nope'"):
        parse_length("nope", "input")
    with pytest.raises(ValueError, match="lognormal needs numeric median"):
        parse_length({"lognormal": {"median": "x"}}, "output")
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_length(0, "output")
