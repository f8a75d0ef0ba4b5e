"""Hostile input over every endpoint: each answer is a 4xx envelope, never a 5xx, even where aiohttp's parser refuses it.

Hypothesis draws JSON bodies, raw bytes and headers; the fixed corpus covers what random drawing
rarely hits (deep nesting, huge numbers, invalid UTF-8, oversized headers and bodies, smuggling).
"""

from __future__ import annotations

import asyncio
import itertools

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.chaos.hostile import hostile_corpus, judge, raw_request, send_raw, trickle
from loadtest.chaos.stack import ChaosStack, wait_until
from tests.chaos.conftest import BETA_KEY, MODEL

_PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/state", "/metrics", "/healthz", "/readyz", "/openapi.json", "/x"])
_METHODS = st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
# Bodies that look like requests, so the fuzzing reaches past "invalid JSON" into validation and classification.
_REQUESTS = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), _JSON)},
    optional={"messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"])}, optional={"content": _JSON}), max_size=3), _JSON),
              "prompt": _JSON, "max_tokens": _JSON, "stream": _JSON, "temperature": _JSON, "n": _JSON, "stop": _JSON,
              "stream_options": _JSON, "tools": _JSON, "max_completion_tokens": _JSON},
)
_FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_AUTH = ("Authorization", f"Bearer {BETA_KEY}")


def _verdict(stack: ChaosStack, raw: bytes) -> str:
    return judge(asyncio.run(send_raw(stack.gateway_port, raw)))


@_FUZZ
@given(body=_REQUESTS, path=_PATHS, method=_METHODS)
def test_request_shaped_json(hostile_stack: ChaosStack, body: dict, path: str, method: str) -> None:
    raw = raw_request(path, orjson.dumps({**body, "max_tokens": 1} if body.get("model") == MODEL and "max_tokens" not in body else body), [_AUTH, ("Content-Type", "application/json")], method)
    assert _verdict(hostile_stack, raw) == "ok"


@_FUZZ
@given(body=st.binary(max_size=300), path=_PATHS)
def test_raw_bytes(hostile_stack: ChaosStack, body: bytes, path: str) -> None:
    assert _verdict(hostile_stack, raw_request(path, body, [_AUTH])) == "ok"


@_FUZZ
@given(headers=st.lists(st.tuples(st.sampled_from(["Authorization", "x-polymorph-tier", "X-Forwarded-For", "Content-Type", "Accept", "X-Fuzz"]),
                                  st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=60)), max_size=5))
def test_headers(hostile_stack: ChaosStack, headers: list[tuple[str, str]]) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert _verdict(hostile_stack, raw_request("/v1/chat/completions", body, headers)) == "ok"


def test_fixed_corpus_and_mutations(hostile_stack: ChaosStack) -> None:
    async def run() -> dict[str, str]:
        found = {}
        for label, raw in itertools.islice(hostile_corpus(BETA_KEY, MODEL, hostile_stack.plan.max_body_bytes, seed=3), 150):
            found[label] = judge(await send_raw(hostile_stack.gateway_port, raw))
        return found

    verdicts = asyncio.run(run())
    assert {label: v for label, v in verdicts.items() if v != "ok"} == {}


def test_trickling_bodies_do_not_block_other_clients(hostile_stack: ChaosStack) -> None:
    async def run() -> tuple[list[float], list[str]]:
        raw = raw_request("/v1/chat/completions", b'{"model": "' + b"x" * 40 + b'"}', [_AUTH])
        tricklers = [asyncio.create_task(trickle(hostile_stack.gateway_port, raw, 1.5)) for _ in range(30)]
        await asyncio.sleep(0.3)
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        verdicts = []
        for _ in range(5):
            verdicts.append(judge(await asyncio.wait_for(send_raw(hostile_stack.gateway_port, raw_request("/v1/chat/completions", body, [_AUTH])), 1.0)))
        return await asyncio.gather(*tricklers), verdicts

    held_s, verdicts = asyncio.run(run())
    assert verdicts == ["ok"] * 5
    assert min(held_s) >= 1.4  # they were served concurrently, not refused


def test_gateway_healthy_and_log_clean_after_fuzzing(hostile_stack: ChaosStack) -> None:
    # this test may run on a worker of its own: it sends one request the parser refuses itself
    refused = asyncio.run(send_raw(hostile_stack.gateway_port, raw_request("/v1/chat/completions", b"{}", [_AUTH, ("X-Big", "a" * 20000)])))
    assert refused is not None and judge(refused) == "ok" and refused.status == 400
    answer = asyncio.run(send_raw(hostile_stack.gateway_port, raw_request("/healthz", b"", [], "GET")))
    assert answer is not None and answer.status == 200 and hostile_stack.gateway_alive()
    wait_until("the refusal's log line", lambda: "rejected malformed HTTP request: LineTooLong" in hostile_stack.gateway_log(), 5)
    log = hostile_stack.gateway_log()
    assert BETA_KEY not in log
    assert "Traceback" not in log  # a request aiohttp's parser refuses is one line (it was a traceback each)
