"""Tenants stay apart: keys, models, tiers, admin, rate limits, metrics and logs; CR/LF cannot inject."""

from __future__ import annotations

import asyncio
import time

import orjson

from loadtest.chaos.hostile import RawAnswer, has_envelope, raw_request, send_raw
from loadtest.chaos.stack import ChaosStack
from tests.chaos.conftest import ALPHA_KEY, ALPHA_RPM, BETA_KEY, MODEL

_MARKER = "zebra-prompt-marker-4417"


def _chat(stack: ChaosStack, headers: list[tuple[str, str]], model: str = MODEL, path: str = "/v1/chat/completions") -> RawAnswer:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": f"{_MARKER} hello"}], "max_tokens": 2})
    answer = asyncio.run(send_raw(stack.gateway_port, raw_request(path, body, [("Content-Type", "application/json"), *headers])))
    assert answer is not None
    return answer


def _get(stack: ChaosStack, path: str, headers: list[tuple[str, str]]) -> RawAnswer:
    answer = asyncio.run(send_raw(stack.gateway_port, raw_request(path, b"", headers, "GET")))
    assert answer is not None
    return answer


def test_a_key_never_reaches_another_tenants_models_or_tiers(hostile_stack: ChaosStack) -> None:
    alpha = ("Authorization", f"Bearer {ALPHA_KEY}")
    denied_model = _chat(hostile_stack, [alpha], model="garbage-model")
    assert denied_model.status == 403 and b"model_not_allowed" in denied_model.body
    for tier in ("interactive", "INTERACTIVE", "interactive ", "batch,interactive"):
        answer = _chat(hostile_stack, [alpha, ("x-polymorph-tier", tier)])
        assert answer.status in (400, 403) and has_envelope(answer.body), tier
    listed = orjson.loads(_get(hostile_stack, "/v1/models", [alpha]).body)
    assert [m["id"] for m in listed["data"]] == [MODEL]


def test_admin_endpoints_need_the_admin_token(hostile_stack: ChaosStack) -> None:
    for headers in ([], [("Authorization", f"Bearer {BETA_KEY}")], [("Authorization", "Bearer ")], [("Authorization", hostile_stack.plan.admin_token)]):
        answer = _get(hostile_stack, "/admin/state", headers)
        assert answer.status == 401 and has_envelope(answer.body)
    assert _get(hostile_stack, "/admin/state", [("Authorization", f"Bearer {hostile_stack.plan.admin_token}")]).status == 200


def test_rate_limits_survive_header_tricks(hostile_stack: ChaosStack) -> None:
    statuses = []
    for i in range(ALPHA_RPM + 3):
        tricks = [
            ("Authorization", f"Bearer {ALPHA_KEY}"),
            ("X-Forwarded-For", f"10.0.0.{i}"),
            ("X-Real-IP", f"10.1.0.{i}"),
            ("Forwarded", f"for=10.2.0.{i}"),
            ("x-polymorph-tenant", "beta"),
        ]
        statuses.append(_chat(hostile_stack, tricks).status)
    assert statuses[:ALPHA_RPM] == [200] * ALPHA_RPM and set(statuses[ALPHA_RPM:]) == {429}
    # a second key cannot lend its budget: two Authorization headers are refused outright
    doubled = [("Authorization", f"Bearer {ALPHA_KEY}"), ("Authorization", f"Bearer {BETA_KEY}")]
    assert _chat(hostile_stack, doubled).status == 400


def test_metrics_and_logs_hold_no_prompts_or_keys(hostile_stack: ChaosStack) -> None:
    _chat(hostile_stack, [("Authorization", f"Bearer {BETA_KEY}")])
    _chat(hostile_stack, [("Authorization", "Bearer sk-not-a-real-key-0099")])
    metrics = _get(hostile_stack, "/metrics", []).body.decode()
    time.sleep(0.5)  # the access log is flushed in batches
    log = hostile_stack.gateway_log()
    for secret in (_MARKER, ALPHA_KEY, BETA_KEY, "sk-not-a-real-key-0099", hostile_stack.plan.admin_token):
        assert secret not in metrics and secret not in log, secret


def test_keys_are_never_echoed(hostile_stack: ChaosStack) -> None:
    for key in ("sk-wrong-key-echo-test", ALPHA_KEY[:-1]):
        answer = _chat(hostile_stack, [("Authorization", f"Bearer {key}")])
        assert answer.status == 401 and key.encode() not in answer.body


def test_crlf_in_client_values_cannot_split_headers_or_log_lines(hostile_stack: ChaosStack) -> None:
    evil_model = 'x\r\nX-Injected: 1\r\n\r\n{"ts": 0, "tenant": "forged"}'
    answer = _chat(hostile_stack, [("Authorization", f"Bearer {BETA_KEY}")], model=evil_model)
    assert answer.status == 404 and "x-injected" not in answer.headers and has_envelope(answer.body)
    evil_path = "/v1/x%0d%0aX-Injected:%201"
    assert "x-injected" not in _get(hostile_stack, evil_path, []).headers
    time.sleep(0.5)
    lines = [line for line in hostile_stack.gateway_log().splitlines() if line.startswith("{")]
    assert all(orjson.loads(line).get("tenant") != "forged" for line in lines)
