"""The online output-length predictor: priors, convergence, max_tokens cap, bounded memory."""

from __future__ import annotations

import numpy as np

from classifiers.output_predictor import DOMAIN_PRIORS, OutputPredictor


def test_prior_then_convergence_on_a_synthetic_stream() -> None:
    predictor = OutputPredictor(max_history_per_key=256)
    assert predictor.predict("acme", "qa", 100, None) == DOMAIN_PRIORS["qa"]
    rng = np.random.default_rng(7)
    stream = rng.lognormal(mean=np.log(600), sigma=0.5, size=2000).astype(int)
    for value in stream:
        predictor.observe("acme", "qa", int(value))
    p50, p90 = predictor.predict("acme", "qa", 100, None)
    true_p50, true_p90 = np.percentile(stream[-256:], [50, 90])
    assert abs(p50 - true_p50) / true_p50 < 0.12
    assert abs(p90 - true_p90) / true_p90 < 0.15


def test_tracks_a_shift_and_caps_at_max_tokens() -> None:
    predictor = OutputPredictor(max_history_per_key=64)
    for _ in range(500):
        predictor.observe("t", "code", 100)
    for _ in range(500):
        predictor.observe("t", "code", 1000)
    p50, p90 = predictor.predict("t", "code", 50, None)
    assert 900 <= p50 <= 1100 and p90 >= p50
    assert predictor.predict("t", "code", 50, 256) == (256, 256)


def test_other_tenants_learn_from_the_domain_wide_sketch() -> None:
    predictor = OutputPredictor()
    for _ in range(200):
        predictor.observe("a", "math", 40)
    p50, _ = predictor.predict("b", "math", 50, None)
    assert p50 < DOMAIN_PRIORS["math"][0] / 2


def test_memory_is_bounded_by_key_count() -> None:
    predictor = OutputPredictor(max_keys=10)
    for i in range(100):
        predictor.observe(f"tenant-{i}", "chat", 10)
    assert predictor.num_keys == 10
