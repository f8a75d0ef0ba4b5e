"""Usage on every stream, and tiers reaching the engine as request priorities.

The real `openai` SDK talks to a real gateway process. Behind it: an emulated replica (a stream
without ``include_usage`` still counts its tokens, and its client sees no usage chunk), and a small
real aiohttp server in this process that answers with the body it received (what the gateway sent
each engine kind: ``priority`` per tier, ``stream_options``), streaming its usage chunk in pieces.
Last, a real llama.cpp server behind the gateway.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import orjson
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from gateway.stream_usage import UsageChunkFilter, upstream_body
from tests.support.engines import llama_server
from tests.support.procs import Proc, start_emulator, start_gateway, write_tenant

MODEL = "llama-3.1-8b"
KEY = "sk-test-usage"
TIERS = {"interactive": 0, "standard": 1, "batch": 2}  # the default tiers' priorities

# -- the usage-only chunk filter on bytes ---------------------------------------------------------

_ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
_TEXT = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"\\"choices\\":[] is text"}}]}\n\n'
_LAST = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
_USAGE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
_DONE = b"data: [DONE]\n\n"


def _filtered(pieces: list[bytes]) -> bytes:
    usage_filter = UsageChunkFilter()
    return b"".join(usage_filter.feed(piece) for piece in pieces) + usage_filter.flush()


def test_the_usage_only_chunk_is_dropped_however_the_stream_is_split() -> None:
    stream = _ROLE + _TEXT + _LAST + _USAGE + _DONE
    expected = _ROLE + _TEXT + _LAST + _DONE
    assert _filtered([stream]) == expected
    for cut in range(1, len(stream)):
        assert _filtered([stream[:cut], stream[cut:]]) == expected, cut
    assert _filtered([stream[i : i + 1] for i in range(len(stream))]) == expected


def test_crlf_events_and_usage_on_every_chunk() -> None:
    crlf = (_TEXT + _USAGE + _DONE).replace(b"\n", b"\r\n")
    assert _filtered([crlf[:150], crlf[150:]]) == (_TEXT + _DONE).replace(b"\n", b"\r\n")
    # vLLM's continuous_usage_stats: content chunks carry usage too; only the usage-only chunk goes
    with_usage = _TEXT.replace(b"]}\n\n", b'],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}\n\n')
    assert _filtered([with_usage + _USAGE + _DONE]) == with_usage + _DONE


def test_a_stream_without_a_usage_chunk_passes_unchanged() -> None:
    stream = _ROLE + _TEXT + _LAST + _DONE
    assert _filtered([stream[:40], stream[40:]]) == stream
    assert _filtered([stream, b"data: {unfinished"]) == stream + b"data: {unfinished"


def test_upstream_body_splices_or_rewrites_only_what_it_must() -> None:
    raw = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"}"}]} \n'
    body = orjson.loads(raw)
    assert upstream_body(raw, body, False, None) is raw
    spliced = upstream_body(raw, body, True, 2)
    assert orjson.loads(spliced) == {**body, "stream_options": {"include_usage": True}, "priority": 2}
    assert spliced.startswith(raw.rstrip()[:-1])  # the client's bytes, then the new members
    raw = b'{"model":"m","stream":true,"priority":-50,"stream_options":{"continuous_usage_stats":true,"include_usage":false}}'
    rewritten = orjson.loads(upstream_body(raw, orjson.loads(raw), True, 1))
    assert rewritten == {"model": "m", "stream": True, "priority": 1, "stream_options": {"continuous_usage_stats": True, "include_usage": True}}


# -- through a gateway ----------------------------------------------------------------------------


async def _echo(request: web.Request) -> web.StreamResponse:
    """Answer with the body received, as the message text; a stream sends its usage chunk in three writes."""
    received = await request.json()
    text = json.dumps(received, sort_keys=True)
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    if not received.get("stream"):
        message = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return web.json_response({"id": "e", "object": "chat.completion", "created": 0, "model": received["model"], "choices": [message], "usage": usage})
    options = received.get("stream_options") or {}
    every_chunk = {"usage": usage} if options.get("include_usage") and options.get("continuous_usage_stats") else {}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    head = {"id": "e", "object": "chat.completion.chunk", "created": 0, "model": received["model"]}
    for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": text}, None), ({}, "stop")):
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **every_chunk}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if options.get("include_usage"):
        event = b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
        for piece in (event[:20], event[20:-1], event[-1:] + b"data: [DO"):
            await response.write(piece)
            await asyncio.sleep(0.02)  # separate reads at the gateway
        await response.write(b"NE]\n\n")
    else:
        await response.write(b"data: [DONE]\n\n")
    # The SDK closes its connection on [DONE]; an engine that ends its chunked body a little later
    # makes the gateway's handler see its client leave first (it is cancelled): the stream still counts.
    await asyncio.sleep(0.3)
    await response.write_eof()
    return response


async def _health(request: web.Request) -> web.Response:
    return web.json_response({})


@dataclass
class Echo:
    url: str
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner
    thread: threading.Thread


def _start_echo() -> Echo:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _echo)
    app.router.add_get("/health", _health)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return Echo(f"http://127.0.0.1:{port}", loop, runner, thread)


def _stop_echo(echo: Echo) -> None:
    asyncio.run_coroutine_threadsafe(echo.runner.cleanup(), echo.loop).result(10)
    echo.loop.call_soon_threadsafe(echo.loop.stop)
    echo.thread.join(10)
    echo.loop.close()


@dataclass
class Stack:
    gateway: Proc
    client: openai.OpenAI


def _pool(name: str, urls: list[str], engine: dict[str, object]) -> dict[str, object]:
    return {"name": name, "model": name, "engine": engine, "replicas": {"urls": urls}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("usage")
    echo = _start_echo()
    emulator = start_emulator(tmp, "emu")
    gateway: Proc | None = None
    try:
        tenants = tmp / "tenants"
        tenants.mkdir()
        write_tenant(tenants, "main", KEY, tiers=list(TIERS), default_tier="standard", rate_limits={"requests_per_min": 100000})
        pools = [
            {"name": "main", "model": MODEL, "replicas": {"urls": [emulator.url]}},
            _pool("vllm-prio", [echo.url], {"kind": "vllm", "schedule_policy": "priority"}),
            {**_pool("sglang-prio", [echo.url], {"kind": "sglang", "schedule_policy": "priority"}), "adapters": {"sg-sql": "/adapters/sql"}},
            _pool("llamacpp", [echo.url], {"kind": "llamacpp"}),
            {**_pool("vllm-fcfs", [echo.url], {"kind": "vllm"}), "adapters": {"vl-sql": "/adapters/sql"}},
        ]
        config = {"server": {"host": "127.0.0.1"}, "upstream": {"health_interval_s": 0.3}, "tenants_dir": "tenants", "fleet": {"pools": pools}}
        (tmp / "config.yaml").write_text(json.dumps(config))
        gateway = start_gateway(tmp, ["--config", str(tmp / "config.yaml")])
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        yield Stack(gateway, client)
        client.close()
    finally:
        if gateway is not None:
            gateway.stop()
        emulator.stop()
        _stop_echo(echo)


def _tokens(stack: Stack, kind: str) -> float:
    with urllib.request.urlopen(stack.gateway.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^polymorph_tokens_total\{{kind="{kind}",tenant="main"\}} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


def _tokens_after(stack: Stack, kind: str, before: float) -> float:
    """The counter once the request is recorded (that happens just after its stream's last byte; the wait
    is generous for a busy machine, two test workers on two cores)."""
    deadline = time.monotonic() + 20
    while (now := _tokens(stack, kind)) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


def test_a_stream_without_include_usage_counts_its_tokens_and_shows_no_usage_chunk(stack: Stack) -> None:
    before = _tokens(stack, "completion"), _tokens(stack, "prompt")
    stream = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=9, stream=True)
    chunks = list(stream)
    assert chunks and all(chunk.choices and chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert _tokens_after(stack, "completion", before[0]) - before[0] == 9
    assert _tokens_after(stack, "prompt", before[1]) > before[1]

    before_text = _tokens(stack, "completion")
    pieces = list(stack.client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=6, stream=True))
    assert pieces and all(piece.choices and piece.usage is None for piece in pieces)
    assert _tokens_after(stack, "completion", before_text) - before_text == 6


def test_a_stream_with_include_usage_gets_its_usage_chunk(stack: Stack) -> None:
    before = _tokens(stack, "completion")
    stream = stack.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert _tokens_after(stack, "completion", before) - before == 7


def _sent(stack: Stack, pool: str, tier: str, **extra: object) -> dict[str, object]:
    """What the echo replica of ``pool`` received for a request of ``tier``."""
    completion = stack.client.chat.completions.create(
        model=pool, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_headers={"x-polymorph-tier": tier}, extra_body=extra or None
    )
    content = completion.choices[0].message.content
    assert content is not None
    received: dict[str, object] = json.loads(content)
    return received


def test_tiers_reach_engines_that_schedule_by_priority_in_their_own_convention(stack: Stack) -> None:
    for tier, priority in TIERS.items():
        assert _sent(stack, "vllm-prio", tier)["priority"] == priority  # vLLM: lower runs first
        assert _sent(stack, "sglang-prio", tier)["priority"] == priority  # sglang too: launched with --schedule-low-priority-values-first
    # the tenant's tier decides, not the client
    assert _sent(stack, "vllm-prio", "batch", priority=-100)["priority"] == 2
    # an engine without priority scheduling, or without priorities at all, gets the client's body as sent
    assert "priority" not in _sent(stack, "vllm-fcfs", "interactive")
    assert "priority" not in _sent(stack, "llamacpp", "interactive")
    assert _sent(stack, "llamacpp", "interactive", priority=5)["priority"] == 5
    assert _sent(stack, "vllm-fcfs", "batch", priority=5)["priority"] == 5


def test_a_stream_asks_the_engine_for_usage_and_hides_a_usage_chunk_split_over_reads(stack: Stack) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    chunks = list(stack.client.chat.completions.create(model="sglang-prio", messages=messages, stream=True, extra_headers={"x-polymorph-tier": "batch"}))
    assert chunks and all(chunk.choices for chunk in chunks)
    received = json.loads("".join(c.choices[0].delta.content or "" for c in chunks))
    assert received["stream_options"] == {"include_usage": True} and received["priority"] == 2

    # other stream options are kept; usage on every chunk (vLLM's continuous_usage_stats) still streams
    before = _tokens(stack, "completion")
    chunks = list(stack.client.chat.completions.create(model="vllm-fcfs", messages=messages, stream=True, extra_body={"stream_options": {"continuous_usage_stats": True}}))
    assert chunks and all(chunk.choices for chunk in chunks)
    received = json.loads("".join(c.choices[0].delta.content or "" for c in chunks))
    assert received["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    # the echo ends its body 0.3 s after [DONE] and the SDK closes on [DONE]: the gateway's handler is
    # cancelled before the end of stream, and the stream still counts (it did not before; flaky, then pinned)
    assert _tokens_after(stack, "completion", before) - before == 4, stack.gateway.log()[-3000:]

    chunks = list(stack.client.chat.completions.create(model="llamacpp", messages=messages, stream=True, stream_options={"include_usage": True}))
    assert not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 9


def test_a_real_llama_server_stream_counts_its_tokens_without_showing_usage(llama_server_bin: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    with llama_server(llama_server_bin, tiny_gguf, log_path=tmp_path / "llama-server.log") as llama:
        tenants = tmp_path / "tenants"
        tenants.mkdir()
        write_tenant(tenants, "main", KEY, rate_limits={"requests_per_min": 100000})
        pools = [{"name": "llama", "model": "tiny-llama", "engine": {"kind": "llamacpp"}, "replicas": {"urls": [llama.url]}}]
        config = {"server": {"host": "127.0.0.1"}, "tenants_dir": "tenants", "fleet": {"pools": pools}}
        (tmp_path / "config.yaml").write_text(json.dumps(config))
        gateway = start_gateway(tmp_path, ["--config", str(tmp_path / "config.yaml")])
        try:
            with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
                stack = Stack(gateway, client)
                request: dict[str, object] = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "stream": True, "extra_body": {"ignore_eos": True}}
                before = _tokens(stack, "completion")
                chunks = list(client.chat.completions.create(**request))  # type: ignore[call-overload]
                assert chunks and all(chunk.choices and chunk.usage is None for chunk in chunks), (chunks[-2:], gateway.log()[-3000:])
                assert _tokens_after(stack, "completion", before) - before == 8, gateway.log()[-3000:]
                asked = list(client.chat.completions.create(**request, stream_options={"include_usage": True}))  # type: ignore[call-overload]
                assert not asked[-1].choices and asked[-1].usage is not None and asked[-1].usage.completion_tokens == 8
        finally:
            gateway.stop()


def test_an_adapter_is_named_to_each_engine_as_it_selects_one(stack: Stack) -> None:
    """vLLM selects a LoRA adapter by its name as the model; sglang by "<base>:<adapter>" (a bare adapter
    name would be answered by the base model)."""
    assert _sent(stack, "vl-sql", "standard")["model"] == "vl-sql"
    assert _sent(stack, "sg-sql", "standard")["model"] == "sglang-prio:sg-sql"
    assert _sent(stack, "sglang-prio", "standard")["model"] == "sglang-prio"  # the base model is sent as it came

