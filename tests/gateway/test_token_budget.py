"""Every choice counts toward a request's token budget: ``n`` completions (or ``best_of`` candidates)
of up to ``max_tokens`` each are charged to the tenant's tokens-per-minute limit at admission. (A
request larger than the whole bucket is let through once when the bucket is full, or it could never
run; the tenant then owes the rest.)"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support.procs import start_gateway, write_tenant

KEY = "sk-test-budget"


def test_n_and_best_of_multiply_the_tokens_a_request_is_charged(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "small", KEY, rate_limits={"tokens_per_min": 2000, "requests_per_min": 1000})
    config = {"server": {"access_log": False}, "tenants_dir": "tenants",
              "fleet": {"pools": [{"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "replicas": {"emulated": 1}}],
                        "emulator_speed": 20.0}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(tmp_path / "config.yaml")])
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
        one = client.chat.completions.create(model="llama-3.1-8b", messages=messages, max_tokens=300)  # ~1,700 of 2,000 left
        with pytest.raises(openai.RateLimitError) as four:  # 4 x 500 tokens: more than is left
            client.chat.completions.create(model="llama-3.1-8b", messages=messages, max_tokens=500, n=4)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="llama-3.1-8b", prompt="Hi", max_tokens=500, best_of=4)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="llama-3.1-8b", prompt="Hi", max_tokens=10, n=3, best_of=2)
        alone = client.chat.completions.create(model="llama-3.1-8b", messages=messages, max_tokens=500)  # one choice fits
    finally:
        gateway.stop()
    assert four.value.code == "token_rate_limit_exceeded"
    assert bad.value.code == "invalid_value" and "best_of" in str(bad.value)
    assert one.choices and alone.choices
