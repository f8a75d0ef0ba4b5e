"""A request whose context a replica cannot hold is the request's fault, not the replica's: the gateway tries
another replica (a pool with a longer context), keeps the first in service, and answers OpenAI's 400
``context_length_exceeded`` when no replica holds it. Real llama-servers (tests/support/engines.py)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import openai
import pytest

from gateway.engine_errors import context_exceeded, request_refused
from tests.gateway.test_real_drift import KEY, cpu_fleet_config
from tests.support.procs import start_gateway

SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.mark.parametrize(("status", "body", "found"), [
    # llama.cpp: a sequence ran out of KV cells (slots share one cache with --kv-unified)
    (500, b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}', "Context size has been exceeded."),
    # llama.cpp: the prompt is longer than a slot's context
    (400, b'{"error":{"code":400,"message":"request (1348 tokens) exceeds the available context size (256 tokens), try increasing it",'
          b'"type":"exceed_context_size_error","n_prompt_tokens":1348,"n_ctx":256}}',
     "request (1348 tokens) exceeds the available context size (256 tokens), try increasing it"),
    # vLLM, its flat error object and OpenAI's envelope
    (400, b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens. However, you requested 4200 tokens.",'
          b'"type":"BadRequestError","param":null,"code":400}',
     "This model's maximum context length is 2048 tokens. However, you requested 4200 tokens."),
    (400, b'{"error":{"message":"The decoder prompt (length 4100) is longer than the maximum model length of 2048.","type":"BadRequestError"}}',
     "The decoder prompt (length 4100) is longer than the maximum model length of 2048."),
    # sglang, as text
    (400, b"The input (4100 tokens) is longer than the model's context length (2048 tokens).",
     "The input (4100 tokens) is longer than the model's context length (2048 tokens)."),
    # not a context error: a sick replica, a client error of another kind, a success that quotes the phrase
    (500, b'{"error":{"message":"CUDA error: an illegal memory access","type":"server_error"}}', None),
    (400, b'{"error":{"message":"temperature must be non-negative","type":"invalid_request_error"}}', None),
    (200, b'{"choices":[{"message":{"content":"maximum context length"}}]}', None),
])
def test_engine_answers_that_say_the_context_does_not_fit_are_recognised(status: int, body: bytes, found: str | None) -> None:
    assert context_exceeded(status, body) == found


@pytest.mark.parametrize(("status", "body", "found"), [
    # llama.cpp (b1-0c1e570) wraps its parser's 400 in a 500
    (500, b'{"error":{"code":500,"message":"Failed to parse tools: Missing tool function: {\\"type\\":\\"function\\"}; tools = []","type":"server_error"}}',
     'Failed to parse tools: Missing tool function: {"type":"function"}; tools = []'),
    (500, b'{"error":{"code":500,"message":"Failed to parse messages: Missing tool call function: {}","type":"server_error"}}',
     "Failed to parse messages: Missing tool call function: {}"),
    (500, b'{"error":{"code":500,"message":"Failed to parse tool call arguments as JSON: parse error","type":"server_error"}}',
     "Failed to parse tool call arguments as JSON: parse error"),
    (500, b'{"error":{"code":500,"message":"image input is not supported - hint: if this is unexpected, you may need to provide the mmproj",'
          b'"type":"server_error"}}', "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"),
    # a sick replica, and the engine's own 400 (passed on as it is)
    (500, b'{"error":{"message":"CUDA error: an illegal memory access","type":"server_error"}}', None),
    (400, b'{"error":{"code":400,"message":"Failed to parse tools: x","type":"invalid_request_error"}}', None),
])
def test_engine_500s_for_a_request_it_could_not_parse_are_recognised(status: int, body: bytes, found: str | None) -> None:
    assert request_refused(status, body) == found


def _metric(url: str, name: str, label: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


@pytest.mark.slow
def test_a_context_too_long_for_one_pool_is_served_by_another_and_no_replica_is_ejected(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    engine = {"kind": "llamacpp", "threads": 1, "max_running_requests": 2}
    # the long prompts' own pool holds 256 tokens (-c 256): each of them is tried there first
    path = cpu_fleet_config(tmp_path, [{"name": "small-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["long-context"],
                                        "engine": {**engine, "max_total_tokens": 256}, "replicas": {"launch": 1}},
                                       {"name": "big-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
                                        "engine": engine, "replicas": {"launch": 1}}])
    gateway = start_gateway(tmp_path, ["--config", str(path)], timeout_s=180.0)
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120.0)
        pools = []
        for _ in range(5):  # more than eject_after_failures (3): an ejection would show
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": SENTENCE * 110}], max_tokens=8)
            pools.append((raw.headers["x-polymorph-shape"], raw.headers["x-polymorph-pool"]))
            assert raw.parse().usage is not None and raw.parse().usage.prompt_tokens > 256
        retries = _metric(gateway.url, "polymorph_upstream_retries_total", 'pool="small-cpu"')
        # streamed: the engine refuses before its first byte, so the stream starts on the other pool
        stream = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "user", "content": SENTENCE * 110}], max_tokens=8, stream=True)
        streamed_pool = stream.headers["x-polymorph-pool"]
        chunks = list(stream.parse())
        with pytest.raises(openai.BadRequestError) as refused:  # longer than any replica's context (the model's 2,048)
            client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": SENTENCE * 400}], max_tokens=8)
        short = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        # an image for a model llama.cpp serves without a projector: its 500, which ejected the replica after
        # three (503 for everyone after); its parser's 500s are the same case (the gateway checks those fields first)
        malformed = []
        for _ in range(4):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="tiny-llama", max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
            malformed.append(info.value.body)
        after = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        ejections = _metric(gateway.url, "polymorph_replica_ejections_total", "")
    finally:
        gateway.stop()
    assert pools == [("long-context", "big-cpu")] * 5, pools
    # each long prompt went to small-cpu first, then on: had its breaker counted them, it would have been ejected
    # after three, and the last two would have gone straight to big-cpu
    assert retries == 5 and ejections == 0
    assert streamed_pool == "big-cpu" and chunks and chunks[-1].choices[0].finish_reason is not None
    error = refused.value.body
    assert refused.value.status_code == 400 and isinstance(error, dict) and error["code"] == "context_length_exceeded", error
    assert "cannot hold this request's context" in error["message"] and "Traceback" not in error["message"], error
    assert short.choices[0].message.content is not None and after.choices[0].message.content is not None
    for error in malformed:
        assert isinstance(error, dict) and error["code"] == "invalid_request" and "image input is not supported" in error["message"], error
