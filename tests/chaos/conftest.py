"""One hostile deployment shared by the fuzz, isolation and misbehaving-replica tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.chaos.garbage import GarbageReplica
from loadtest.chaos.stack import ChaosStack, PoolPlan, StackPlan, TenantPlan
from tests.conftest import free_port

MODEL = "Llama-3.1-8B"
ALPHA_KEY, BETA_KEY = "sk-chaos-alpha-secret", "sk-chaos-beta-secret"
ALPHA_RPM = 5


def hostile_plan(garbage_url: str) -> StackPlan:
    return StackPlan(
        pools=(PoolPlan("main", MODEL, 1), PoolPlan("garbage", "garbage-model", 0, shapes=(), external_urls=(garbage_url,))),
        tenants=(
            TenantPlan("alpha", ALPHA_KEY, {"models": [MODEL], "tiers": ["batch", "standard"], "default_tier": "batch",
                                            "rate_limits": {"requests_per_min": ALPHA_RPM}}),
            TenantPlan("beta", BETA_KEY, {"max_concurrency": 10000, "rate_limits": {"requests_per_min": 1e9}}),
        ),
        # A misbehaving replica must never be ejected here: each test sees its own answer, not a 503.
        upstream={"eject_after_failures": 1000, "max_attempts": 1, "first_byte_timeout_s": 2.0, "response_timeout_s": 2.0,
                  "between_chunks_timeout_s": 1.0, "health_interval_s": 0.5},
        max_body_bytes=65536,
    )


@pytest.fixture(scope="package")
def hostile_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    garbage = GarbageReplica(free_port()).start()
    stack = ChaosStack(hostile_plan(garbage.url), Path(tmp_path_factory.mktemp("hostile")))
    try:
        yield stack.start()
    finally:
        stack.stop()
        garbage.stop()
