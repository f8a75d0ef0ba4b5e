"""Tenant limits and the retry budget, exact under an injected clock."""

from __future__ import annotations

from dataclasses import replace

from gateway.admission import TenantLimiter, TokenBucket
from gateway.config import demo_tenant
from gateway.retry_budget import RetryBudget
from kernels.tiers import DEFAULT_TIERS

TENANT = replace(demo_tenant(DEFAULT_TIERS), requests_per_min=60.0, tokens_per_min=600.0, max_concurrency=2)


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=4.0, now=0.0)
    bucket.take(4.0, 0.0)
    assert bucket.wait_s(1.0, 0.0) == 0.5
    assert bucket.wait_s(1.0, 0.5) == 0.0
    assert bucket.wait_s(4.0, 100.0) == 0.0
    assert bucket.level == 4.0  # full again, never above the burst
    # a request larger than the burst passes only from a full bucket, so it is never starved
    assert bucket.wait_s(9.0, 100.0) == 0.0
    bucket.take(9.0, 100.0)
    assert bucket.wait_s(1.0, 100.0) == 3.0


def test_concurrency_cap_refuses_then_admits_after_release() -> None:
    limiter = TenantLimiter(TENANT, now=0.0)
    assert limiter.admit(10, 0.0) is None and limiter.admit(10, 0.0) is None
    refusal = limiter.admit(10, 0.0)
    assert refusal is not None and refusal.code == "concurrency_limit_exceeded"
    limiter.release()
    assert limiter.admit(10, 0.0) is None


def test_request_rate_refusal_says_when_to_retry_and_takes_nothing() -> None:
    limiter = TenantLimiter(replace(TENANT, max_concurrency=10**6), now=0.0)
    for _ in range(60):
        assert limiter.admit(1, 0.0) is None
    refusal = limiter.admit(1, 0.0)
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert abs(refusal.retry_after_s - 1.0) < 1e-9  # one request a second refills
    assert limiter.admit(1, 1.0) is None


def test_token_rate_limit_counts_prompt_and_output_tokens() -> None:
    limiter = TenantLimiter(replace(TENANT, max_concurrency=10**6), now=0.0)
    assert limiter.admit(550, 0.0) is None
    refusal = limiter.admit(100, 0.0)
    assert refusal is not None and refusal.code == "token_rate_limit_exceeded"
    assert abs(refusal.retry_after_s - 5.0) < 1e-9  # 50 tokens short at 10 tokens a second


def test_retry_budget_bounds_retries_to_a_share_of_requests() -> None:
    budget = RetryBudget(floor_per_s=0.0001)
    spent = 0
    for _ in range(1000):
        budget.on_request(0.0)
        spent += budget.try_spend(0.0, 0.1)
    assert spent == 100  # 10% of the requests; the floor adds 0.001 over the window


def test_retry_budget_retries_a_burst_of_failures_the_recent_requests_pay_for() -> None:
    # 10 s at 50 requests a second, then the replica taking half of them fails the 25 in flight at once
    budget = RetryBudget()
    for i in range(500):
        budget.on_request(i / 50)
    assert all(budget.try_spend(10.0, 0.2) for _ in range(25))  # a bucket of 10 refused 15 of these


def test_retry_budget_holds_an_outage_to_the_ratio_plus_the_floor() -> None:
    budget = RetryBudget(floor_per_s=5.0, window_s=10.0)
    spent = 0
    for i in range(60 * 50):  # every request of a 60 s outage fails and asks for a retry
        now = i / 50
        budget.on_request(now)
        spent += budget.try_spend(now, 0.2) + budget.try_spend(now, 0.2)
    assert 0.2 * 3000 <= spent <= 0.2 * 3000 + 5.0 * (60 + 10)
    # a window later, the outage's requests and retries have expired: the floor alone is left
    assert sum(budget.try_spend(200.0, 0.2) for _ in range(100)) == 50


def test_retry_budget_spends_at_the_ratio_of_the_config_each_retry_runs_on() -> None:
    budget = RetryBudget(floor_per_s=0.0001)
    for _ in range(100):
        budget.on_request(0.0)
    assert not budget.try_spend(0.0, 0.0)  # a reload set the ratio to 0: no retries
    assert sum(budget.try_spend(0.0, 0.5) for _ in range(100)) == 50  # and back to 0.5: half the window's requests
