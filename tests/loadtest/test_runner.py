"""The runner against the fast stub backend (a real subprocess on loopback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import orjson
import pytest

from loadtest.client import prepare
from loadtest.fast_backend import fast_backend_process
from loadtest.runner import RunnerConfig, TargetUnreachable, run_async
from loadtest.spec import RequestSpec, make_workload
from tests.conftest import free_port


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    decisions = tmp_path_factory.mktemp("decisions") / "decisions.jsonl"
    decisions.write_text("\n".join(json.dumps(entry) for entry in (
        {"at": 1.0e12, "kind": "repartition", "pools": {"a": 2}},
        {"ts": 1.0e12 + 5, "type": "recompile"},
        {"no_time": True},
    )))
    with fast_backend_process(None, "--routing-headers", "--itl-ms", "1", "--decisions", str(decisions)) as url:
        yield url


def _workload(num: int = 40, gap_s: float = 0.01, **fields: object):  # type: ignore[no-untyped-def]
    specs = [RequestSpec(i * gap_s, 20 + i, 5 + i % 3, label="t", **fields) for i in range(num)]  # type: ignore[arg-type]
    return make_workload("unit", specs, num * gap_s)


def test_streaming_open_loop_measures_every_request(backend: str) -> None:
    config = RunnerConfig(target_url=backend + "/v1", progress=False)
    result = asyncio.run(run_async(_workload(), config))
    assert result.model == "fast-backend" and result.mode == "open-loop"
    assert len(result.records) == 40 and all(record.ok for record in result.records)
    for record in result.records:
        assert record.input_tokens == record.target_input_tokens  # the prompt is what the server counts
        assert record.output_tokens == record.target_output_tokens
        assert len(record.itl_s) == record.output_tokens - 1
        assert record.ttft_s is not None and record.tpot_s is not None and record.e2e_s is not None
        assert 0 < record.ttft_s <= record.e2e_s and 0 < record.tpot_s < record.e2e_s
        assert record.lag_s >= 0
        assert (record.pool, record.replica, record.shape) == ("fast-pool", "fast-0", "short-chat")
    assert [record.index for record in result.records] == list(range(40))


def test_non_streaming_has_no_ttft_but_an_end_to_end_time(backend: str) -> None:
    config = RunnerConfig(target_url=backend, stream=False, progress=False)
    result = asyncio.run(run_async(_workload(num=10), config))
    assert all(r.ok and r.ttft_s is None and r.itl_s == () and r.e2e_s is not None for r in result.records)
    assert all(r.output_tokens == r.target_output_tokens for r in result.records)


def test_closed_loop_sends_everything_without_a_schedule(backend: str) -> None:
    config = RunnerConfig(target_url=backend, concurrency=4, progress=False)
    result = asyncio.run(run_async(_workload(num=30, gap_s=10.0), config))  # the schedule would take 300 s
    assert result.mode == "closed-loop" and len(result.records) == 30
    assert all(r.ok for r in result.records) and result.duration_s < 20


def test_decision_log_events_are_fetched_and_placed(backend: str) -> None:
    config = RunnerConfig(target_url=backend, progress=False, admin_token="secret")
    result = asyncio.run(run_async(_workload(num=2), config))
    kinds = [(event["kind"], round(event["at_s"] + result.started_at_unix_s - 1.0e12, 3)) for event in result.gateway_events]
    assert kinds == [("repartition", 0.0), ("recompile", 5.0)]
    assert result.gateway_events[0]["detail"] == {"pools": {"a": 2}}


def test_unreachable_target_raises_a_clear_error() -> None:
    config = RunnerConfig(target_url=f"http://127.0.0.1:{free_port()}", progress=False)
    with pytest.raises(TargetUnreachable, match="cannot reach the target http://127.0.0.1"):
        asyncio.run(run_async(_workload(num=1), config))


def test_requests_still_running_after_the_drain_timeout_are_recorded_unfinished() -> None:
    with fast_backend_process(None, "--ttft-ms", "3000") as slow:
        config = RunnerConfig(target_url=slow, progress=False, drain_timeout_s=0.3)
        result = asyncio.run(run_async(_workload(num=3), config))
    assert [r.error for r in result.records] == ["unfinished: no response within the drain timeout"] * 3
    assert not any(r.ok for r in result.records)


def test_request_body_and_headers_carry_tier_key_hash_ids_and_ignore_eos() -> None:
    spec = RequestSpec(0.0, 1100, 77, tenant="acme", tier="batch", hash_ids=(3, 4, 5))
    request = prepare(7, spec, "some text", "m1", stream=True, api_key="sk-acme")
    body = orjson.loads(request.body)
    assert body == {
        "model": "m1", "messages": [{"role": "user", "content": "some text"}], "max_tokens": 77, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "hash_ids": [3, 4, 5],
    }
    assert request.headers["x-polymorph-tier"] == "batch"
    assert request.headers["Authorization"] == "Bearer sk-acme"
    config = RunnerConfig(target_url="http://h/v1/", api_key="sk-all", tenant_to_api_key={"acme": "sk-acme"})
    assert config.base_url == "http://h" and config.key_for("acme") == "sk-acme" and config.key_for("x") == "sk-all"
    assert "hash_ids" not in orjson.loads(prepare(0, RequestSpec(0.0, 5, 5), "t", "m", False, None).body)
