from kernels.compiler.shape import NAMED_SHAPES, TrafficShape, drifted, get_shape, shape_distance, shape_fingerprint, shape_from_samples


def test_named_shapes_follow_the_example_config_rules() -> None:
    assert max(NAMED_SHAPES["short-chat"].prompt_tokens) < 4096
    assert min(NAMED_SHAPES["long-context"].prompt_tokens) >= 4096
    reasoning = NAMED_SHAPES["reasoning"]
    assert set(reasoning.domain_weights()) == {"math", "code"} and min(reasoning.output_tokens) >= 384
    batch = NAMED_SHAPES["batch"]
    assert batch.tier == "batch" and (batch.ttft_p99_s, batch.tpot_p99_s) == (60.0, 0.5)
    assert (NAMED_SHAPES["short-chat"].ttft_p99_s, NAMED_SHAPES["short-chat"].tpot_p99_s) == (1.0, 0.05)


def test_fingerprint_ignores_the_name_and_tracks_content() -> None:
    shape = get_shape("short-chat")
    renamed = TrafficShape.from_dict({**shape.to_dict(), "name": "other"})
    assert shape_fingerprint(renamed) == shape_fingerprint(shape)
    assert shape_fingerprint(drifted(shape, 1.3, 1.0)) != shape_fingerprint(shape)
    assert TrafficShape.from_dict(shape.to_dict()) == shape


def test_distance_orders_drift_by_size() -> None:
    shape = get_shape("reasoning")
    assert shape_distance(shape, shape) == 0.0
    assert shape_distance(shape, drifted(shape, 1.1, 1.1)) < shape_distance(shape, drifted(shape, 2.0, 2.0))
    assert shape_distance(shape, drifted(shape, 1.2, 1.2)) < shape_distance(shape, get_shape("long-context"))


def test_shape_from_samples_summarises_quantiles_mix_and_rate() -> None:
    shape = shape_from_samples("window", list(range(100, 1100, 10)), [200] * 100, ["code"] * 25 + ["chat"] * 75,
                               duration_s=50.0, tier="standard")
    assert shape.prompt_tokens == (199, 397, 595, 793, 991)
    assert shape.domain_weights() == {"chat": 0.75, "code": 0.25}
    assert shape.arrival_rate_rps == 2.0 and shape.ttft_p99_s == 3.0
