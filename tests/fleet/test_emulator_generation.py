"""What the emulator generates for a request, and its fault plan (pure functions, no server)."""

from __future__ import annotations

import pytest

from fleet.emulator.faults import FaultPlan, FaultSpec
from fleet.emulator.generation import (
    BadRequest,
    DomainPredictor,
    cut_at_stop,
    natural_output_tokens,
    parse_chat,
    parse_completion,
    parse_generate,
    text_prefix_hash_ids,
)


@pytest.fixture(scope="module")
def domains() -> DomainPredictor:
    return DomainPredictor()


def test_cut_at_stop_drops_the_stop_text() -> None:
    assert cut_at_stop([" alpha", " beta", " gamma"], ["ta g"]) == ([" alpha", " be"], True)
    assert cut_at_stop([" alpha", " beta"], ["zzz"]) == ([" alpha", " beta"], False)
    assert cut_at_stop([" alpha", " beta"], [" alpha"]) == ([""], True)


def test_natural_lengths_are_deterministic_and_follow_the_domain() -> None:
    assert natural_output_tokens("code", 42) == natural_output_tokens("code", 42)
    classification = sorted(natural_output_tokens("classification", seed) for seed in range(201))
    creative = sorted(natural_output_tokens("creative_writing", seed) for seed in range(201))
    assert classification[100] < 20 < 200 < creative[100]


def test_prefix_hash_ids_share_leading_blocks() -> None:
    shared = "s" * 5000
    first, second = text_prefix_hash_ids(shared + "a" * 3000), text_prefix_hash_ids(shared + "b" * 3000)
    assert len(first) == len(second) == 3
    assert first[:2] == second[:2] and first[2] != second[2]
    assert text_prefix_hash_ids("short") == ()


def test_parse_chat_honours_ignore_eos_min_tokens_and_context(domains: DomainPredictor) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 9, "ignore_eos": True}
    assert parse_chat(body, 131072, domains).output_tokens == 9
    body = {"messages": [{"role": "user", "content": "Classify: good or bad?"}], "min_tokens": 50}
    assert parse_chat(body, 131072, domains).output_tokens >= 50
    with pytest.raises(BadRequest, match="maximum context length"):
        parse_chat({"messages": [{"role": "user", "content": "word " * 400}]}, 100, domains)
    for asked in ({"logprobs": True}, {"top_logprobs": 3}, {"n": 2}):  # what the emulator cannot answer is refused, not dropped
        with pytest.raises(BadRequest, match="emulator does not produce|only n=1"):
            parse_chat({"messages": [{"role": "user", "content": "hi"}], **asked}, 131072, domains)
    for asked in ({"echo": True}, {"logprobs": 0}, {"logprobs": 2}):  # a completion's logprobs is a count: 0 asks for one
        with pytest.raises(BadRequest, match=f"'{next(iter(asked))}'"):
            parse_completion({"prompt": "hi", **asked}, 131072, domains)
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": False}, 131072, domains).output_tokens >= 1
    hashed = parse_chat({"messages": [{"role": "user", "content": "x"}], "hash_ids": [4, 5]}, 131072, domains)
    assert hashed.prefix_hash_ids == (4, 5)


def test_parse_generate_defaults_to_sglang_128_new_tokens(domains: DomainPredictor) -> None:
    generation = parse_generate({"text": "Tell me a long story", "sampling_params": {"ignore_eos": True}}, 131072, domains)
    assert generation.output_tokens == 128 and generation.finish_reason == "length"


def test_fault_spec_validation_and_merge() -> None:
    spec = FaultSpec.from_dict({"error_rate": 0.25, "stall_after_tokens": 3, "stall_s": 1.0}, base=FaultSpec(slowdown=2.0))
    assert (spec.error_rate, spec.stall_after_tokens, spec.stall_s, spec.slowdown) == (0.25, 3, 1.0, 2.0)
    assert FaultSpec.from_dict({"reset": True}, base=spec) == FaultSpec()
    for bad in ({"error_rate": 2}, {"crash_mode": "boom"}, {"nope": 1}, {"fail_after_requests": -1}, {"slowdown": 0}):
        with pytest.raises(ValueError):
            FaultSpec.from_dict(bad)


def test_fault_plan_counts_and_draws_reproducibly() -> None:
    plan = FaultPlan(FaultSpec(fail_after_requests=2))
    assert [plan.on_request().error_status for _ in range(4)] == [None, None, 503, 503]
    first, second = (FaultPlan(FaultSpec(error_rate=0.5, seed=9)) for _ in range(2))
    statuses = [first.on_request().error_status for _ in range(20)]
    assert statuses == [second.on_request().error_status for _ in range(20)]
    assert set(statuses) == {None, 503}
