"""Scenarios: the built-ins load and generate deterministically; drift, ramps, bursts and errors behave."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from loadtest.scenario import ScenarioError, build_workload, builtin_names, load_scenario, parse_scenario

REQUIRED = {"stationary", "drift-step", "drift-ramp", "diurnal", "flash-crowd", "tenant-mix"}


def test_all_named_scenarios_are_built_in_and_documented() -> None:
    assert set(builtin_names()) >= REQUIRED
    readme = (Path(__file__).resolve().parents[2] / "loadtest" / "README.md").read_text()
    for name in builtin_names():
        scenario = load_scenario(name)
        assert scenario.description and f"`{name}`" in readme


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_builtin_scenarios_generate_deterministically_near_their_rate(name: str) -> None:
    scenario = load_scenario(name)
    first = build_workload(scenario, duration_s=120)
    assert first == build_workload(scenario, duration_s=120)
    assert first.num_requests > 100
    assert all(spec.input_tokens >= 1 and spec.output_tokens >= 1 for spec in first.specs)
    assert all(0 <= spec.arrival_s < 120 for spec in first.specs)


def test_drift_step_switches_mix_at_its_onset() -> None:
    workload = build_workload(load_scenario("drift-step"))
    assert workload.drift_onsets_s == (300.0,)
    before = Counter(spec.label for spec in workload.specs if spec.arrival_s < 300)
    after = Counter(spec.label for spec in workload.specs if spec.arrival_s >= 300)
    assert "long-summarization" not in before and before["chat"] > 0.6 * sum(before.values())
    assert after["long-summarization"] + after["code-long-output"] > 0.85 * sum(after.values())
    mean_before = sum(s.input_tokens for s in workload.specs if s.arrival_s < 300) / sum(before.values())
    mean_after = sum(s.input_tokens for s in workload.specs if s.arrival_s >= 300) / sum(after.values())
    assert mean_after > 5 * mean_before


def test_drift_ramp_blends_linearly() -> None:
    workload = build_workload(load_scenario("drift-ramp"))

    def new_share(start_s: float, end_s: float) -> float:
        window = [s for s in workload.specs if start_s <= s.arrival_s < end_s]
        return sum(s.label in ("long-summarization", "code-long-output") for s in window) / len(window)

    assert new_share(0, 150) == 0.0
    assert new_share(270, 330) == pytest.approx(0.45, abs=0.08)  # halfway: half the new mix (0.9 of it is new)
    assert new_share(450, 600) == pytest.approx(0.9, abs=0.05)


def test_flash_crowd_is_one_tenants_burst() -> None:
    workload = build_workload(load_scenario("flash-crowd"))
    assert workload.drift_onsets_s == (200.0,)
    crowd = [s for s in workload.specs if s.label == "crowd-chat"]
    assert {s.tenant for s in crowd} == {"globex"}
    assert min(s.arrival_s for s in crowd) >= 200 and max(s.arrival_s for s in crowd) < 260
    assert len(crowd) / 60 == pytest.approx(60, rel=0.15)


def test_tenant_mix_shared_prefix_ids() -> None:
    workload = build_workload(load_scenario("tenant-mix"), duration_s=60)
    code = [s for s in workload.specs if s.tenant == "initech"]
    assert {s.domain for s in code} == {"code"} and {s.tier for s in code} == {"standard"}
    assert len({s.hash_ids[:2] for s in code}) == 1  # the shared 1,024-token system prompt
    assert len({s.hash_ids[2:] for s in code if len(s.hash_ids) > 2}) == sum(len(s.hash_ids) > 2 for s in code)
    assert all(len(s.hash_ids) == -(-s.input_tokens // 512) for s in code)
    assert not any(s.hash_ids for s in workload.specs if s.tenant != "initech")


def test_rate_override_scales_every_stream() -> None:
    workload = build_workload(load_scenario("tenant-mix"), duration_s=300, rate_rps=30)
    assert workload.num_requests / 300 == pytest.approx(30, rel=0.15)


def test_fitted_arrival_shape_reference() -> None:
    workload = build_workload(load_scenario("azure-code"), duration_s=600)
    assert workload.num_requests / 600 == pytest.approx(2.57, rel=0.5)  # CV 13: very bursty


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("streams: []", "streams: expected a non-empty list"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}}]", r"streams\[0\]: needs `classes:` or `phases:`"),
        ("streams: [{arrival: {process: nope, rate_rps: 1}, classes: [{domain: chat, lengths: azure-conv}]}]",
         r"streams\[0\]\.arrival\.process: unknown arrival process"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{input: bogus, output: 5}]}]",
         r"streams\[0\]\.classes\[0\]: unknown length profile 'bogus'"),
        # a misspelt key below the top, or an unknown domain, was ignored (the default held, chat prompts were sent)
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, ends_s: 5, classes: [{lengths: azure-conv}]}]",
         r"streams\[0\]: unknown keys \['ends_s'\]"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, phases: [{at: 5, classes: [{lengths: azure-conv}]}]}]",
         r"streams\[0\]\.phases\[0\]: unknown keys \['at'\]"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{wieght: 2, lengths: azure-conv}]}]",
         r"streams\[0\]\.classes\[0\]: unknown keys \['wieght'\]"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{domain: coding, lengths: azure-conv}]}]",
         r"streams\[0\]\.classes\[0\]\.domain: unknown domain 'coding'"),
        # a misspelt bound kept the 131,072-token default; min > max, a NaN median or a text bound passed or crashed
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{input: {lognormal: {median: 500, sigma: 0.5}, mx: 900}, "
         "output: 5}]}]", r"input: unknown keys \['mx'\]"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{input: {lognormal: {median: 500, sigma: 0.5}, min: 900, "
         "max: 100}, output: 5}]}]", "min <= max"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{input: {lognormal: {median: .nan, sigma: 0.5}}, output: 5}]}]",
         "numeric median and sigma"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{input: {lognormal: {median: 500, sigma: 0.5}, min: abc}, "
         "output: 5}]}]", "whole token counts"),
        ("streams: [{arrival: {fitted: nowhere}, classes: [{lengths: azure-conv}]}]", "unknown fitted arrival shape"),
        # before: cv was ignored for poisson, an infinite rate passed, a text rate was a TypeError's words
        ("streams: [{arrival: {process: poisson, rate_rps: 1, cv: 3}, classes: [{lengths: azure-conv}]}]",
         r"streams\[0\]\.arrival: poisson takes rate_rps, not cv"),
        ("streams: [{arrival: {process: poisson, rate_rps: .inf}, classes: [{lengths: azure-conv}]}]",
         r"streams\[0\]\.arrival\.rate_rps: expected a finite number"),
        ("streams: [{arrival: {process: gamma, rate_rps: fast}, classes: [{lengths: azure-conv}]}]",
         r"streams\[0\]\.arrival\.rate_rps: expected a finite number >= 0, got 'fast'"),
        ("streams: [{arrival: {process: poisson}, classes: [{lengths: azure-conv}]}]", "poisson needs rate_rps"),
        ("duration_s: -3\nstreams: [{arrival: {process: poisson, rate_rps: 1}, classes: [{lengths: azure-conv}]}]",
         "duration_s: expected a finite number"),
        ("colour: red\nstreams: []", "unknown keys"),
        ("streams: [{arrival: {process: poisson, rate_rps: 1}, phases: [{at_s: 5, classes: [{lengths: azure-conv}]}, "
         "{at_s: 1, classes: [{lengths: azure-conv}]}]}]", "phases must be in order"),
        ("a: [", "invalid YAML"),
    ],
)
def test_bad_scenarios_name_file_and_field(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as caught:
        parse_scenario(text, "mine.yaml")
    assert str(caught.value).startswith("mine.yaml")


def test_a_bad_field_names_its_line() -> None:
    text = ("name: lines\nstreams:\n  - arrival: {process: poisson, rate_rps: 1}\n    phases:\n"
            "      - at_s: 0\n        classes: [{lengths: azure-conv}]\n      - at_s: -5\n        classes: [{lengths: azure-conv}]\n")
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, "mine.yaml")
    assert str(caught.value).startswith("mine.yaml:7: streams[0].phases[1].at_s: expected a finite number >= 0, got -5"), caught.value


def test_unknown_scenario_name_lists_the_builtins() -> None:
    with pytest.raises(ScenarioError, match="not a built-in .*drift-step"):
        load_scenario("no-such-scenario")
