"""The gateway end to end: the real `openai` SDK against a real gateway in front of emulated replicas.

Every error class surfaces as the SDK's matching exception; killed, failing, hanging and crashing
replicas are survived or reported clearly; a client that goes away cancels its upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from loadtest.chaos.hostile import raw_request, send_raw
from loadtest.chaos.stack import wait_until
from tests.conftest import free_port
from tests.support.procs import Proc, set_faults, start_emulator, start_gateway, write_tenant

MODEL = "llama-3.1-8b"
KEY, LIMITED_KEY, ADMIN = "sk-test-main", "sk-test-limited", "admin-token-for-tests"
EJECT_COOLDOWN_S = 1.0  # also how long a failure counts against a replica (fleet/health.py)


@dataclass
class Deployment:
    gateway: Proc
    emulators: list[Proc]
    config_path: Path
    tenants_dir: Path
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def client(self, key: str = KEY) -> openai.OpenAI:
        if key not in self.clients:
            self.clients[key] = openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)
        return self.clients[key]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.gateway.stop()
        for emulator in self.emulators:
            emulator.stop()

    def reset_faults(self) -> None:
        """Clear the replicas' faults, then wait until the gateway holds no failure against them: the tests
        share one gateway, and a failure one test left would join the next test's into an ejection."""
        for emulator in self.emulators:
            if emulator.process.poll() is None:
                set_faults(emulator.url, reset=True)
        deadline = time.monotonic() + EJECT_COOLDOWN_S + 5.0
        while time.monotonic() < deadline:
            replicas = _admin_state(self)["pools"][0]["replicas"]  # type: ignore[index]
            if all(r["health"] == "healthy" and r["failures"] == 0 for r in replicas):
                return
            time.sleep(0.1)
        raise AssertionError(f"the replicas were not cleared of their failures: {replicas}")


def _config(tmp: Path, urls: list[str], dead_port: int) -> Path:
    tenants = tmp / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 100000})
    write_tenant(tenants, "limited", LIMITED_KEY, models=[MODEL], tiers=["batch", "standard"], default_tier="batch", rate_limits={"requests_per_min": 2})
    config = {
        "server": {"host": "127.0.0.1", "admin_token": ADMIN, "max_body_bytes": 65536, "body_read_timeout_s": 1.0},
        "upstream": {
            "connect_timeout_s": 0.5,
            "first_byte_timeout_s": 1.5, "response_timeout_s": 1.5,
            "between_chunks_timeout_s": 1.0,
            "max_attempts": 2,
            "eject_after_failures": 2,
            "eject_cooldown_s": EJECT_COOLDOWN_S,
            "health_interval_s": 0.3,
        },
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [
                {"name": "main", "model": MODEL, "shapes": ["short-chat", "long-context", "reasoning", "batch"], "replicas": {"urls": urls}},
                {"name": "dead", "model": "ghost-model", "replicas": {"urls": [f"http://127.0.0.1:{dead_port}"]}},
            ]
        },
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("e2e")
    emulators = [start_emulator(tmp, f"emu{i}", gpu=gpu) for i, gpu in enumerate(["H100-SXM", "H200"])]
    config_path = _config(tmp, [e.url for e in emulators], free_port())
    try:
        gateway = start_gateway(tmp, ["--config", str(config_path)])
    except Exception:
        for e in emulators:
            e.stop()
        raise
    deployment = Deployment(gateway, emulators, config_path, tmp / "tenants")
    yield deployment
    deployment.close()


@pytest.fixture(autouse=True)
def _clean_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "deployment" in request.fixturenames:
        request.getfixturevalue("deployment").reset_faults()


def _chat(max_tokens: int = 8, text: str = "Say hello to the team.") -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def test_sync_chat_non_stream_with_routing_headers(deployment: Deployment) -> None:
    raw = deployment.client().chat.completions.with_raw_response.create(**_chat(max_tokens=12))  # type: ignore[call-overload]
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 12
    assert raw.headers["x-polymorph-pool"] == "main"
    assert raw.headers["x-polymorph-replica"] in {"main-0", "main-1"}
    assert raw.headers["x-polymorph-shape"] == "short-chat"


def test_sync_stream_passes_chunks_and_final_usage(deployment: Deployment) -> None:
    stream = deployment.client().chat.completions.create(**_chat(max_tokens=10), stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_async_client_chat_and_completions(deployment: Deployment) -> None:
    async def run() -> tuple[int, int, str]:
        async with openai.AsyncOpenAI(base_url=deployment.gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
            chat = await client.chat.completions.create(**_chat(max_tokens=5))  # type: ignore[call-overload]
            completion = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7)
            stream = await client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=6, stream=True)
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            return chat.usage.completion_tokens, completion.usage.completion_tokens, text  # type: ignore[union-attr]

    chat_tokens, completion_tokens, text = asyncio.run(run())
    assert (chat_tokens, completion_tokens) == (5, 7) and text


def test_conversations_without_a_system_prompt_keep_to_their_replica_and_its_prefix_cache(deployment: Deployment) -> None:
    """From its second turn a conversation's history steers it to one replica (prefix affinity), so
    each later turn's prompt is found in that replica's prefix cache; different conversations spread
    over the pool. Before, without a system prompt, every turn went by load."""
    client = deployment.client()
    documents = [f"Document {n}: " + " ".join(f"clause {n}.{i} says the parties agree to term {i * n}." for i in range(120)) for n in range(24)]
    homes: list[str] = []
    followed, cached = [], []
    for n, document in enumerate(documents):
        if n >= 4 and set(homes) == {"main-0", "main-1"}:
            break  # rendezvous ranks hash the replicas' URLs (random ports): a few documents may all rank one first
        messages: list[dict[str, str]] = [{"role": "user", "content": document + "\nSummarise the document."}]
        turns = []
        for question in ("Which clause matters most?", "And the least?"):
            turn = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
            messages += [{"role": "assistant", "content": turn.parse().choices[0].message.content or ""}, {"role": "user", "content": question}]
            turns.append(turn)
        third = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
        homes.append(turns[1].headers["x-polymorph-replica"])
        followed.append(third.headers["x-polymorph-replica"] == homes[-1])
        usage = third.parse().usage
        cached.append(usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0)
    assert all(followed), list(zip(homes, followed, strict=True))
    assert set(homes) == {"main-0", "main-1"}, homes
    assert min(cached) >= 1024, cached


def test_models_lists_what_the_tenant_may_use(deployment: Deployment) -> None:
    assert sorted(m.id for m in deployment.client().models.list()) == ["ghost-model", MODEL]
    assert [m.id for m in deployment.client(LIMITED_KEY).models.list()] == [MODEL]
    # the SDK's models.retrieve (before, 404 unknown_endpoint for every model)
    assert deployment.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as hidden:
        deployment.client(LIMITED_KEY).models.retrieve("ghost-model")
    assert isinstance(hidden.value.body, dict) and hidden.value.body["code"] == "model_not_found"


def test_a_wrong_method_gets_405_with_allow(deployment: Deployment) -> None:
    for path, method, allow in (("/v1/chat/completions", "GET", "POST"), ("/v1/models", "POST", "GET, HEAD"), ("/admin/move", "GET", "POST")):
        request = urllib.request.Request(deployment.gateway.url + path, method=method, data=b"{}" if method == "POST" else None,
                                         headers={"Authorization": f"Bearer {ADMIN if path.startswith('/admin') else KEY}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        info.value.close()
        assert (info.value.code, info.value.headers.get("Allow")) == (405, allow), path


def test_head_answers_each_get_endpoint_as_get_does_without_the_body(deployment: Deployment) -> None:
    """RFC 9110 asks HEAD of every server for its GET resources (monitors and `curl -I` use it); before, each
    of these answered 404 "No such endpoint"."""
    for path, token in (("/healthz", None), ("/readyz", None), ("/metrics", None), ("/openapi.json", None), ("/v1/models", KEY),
                        (f"/v1/models/{MODEL}", KEY), ("/admin/state", ADMIN)):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with urllib.request.urlopen(urllib.request.Request(deployment.gateway.url + path, method="HEAD", headers=headers), timeout=5) as head:
            assert (head.status, head.read()) == (200, b""), path
            assert head.headers.get_content_type() == "application/json" or path == "/metrics", (path, head.headers)


def test_client_errors_map_to_sdk_exceptions(deployment: Deployment) -> None:
    client = deployment.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(**_chat(), temperature=7)  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.AuthenticationError, match="Invalid API key") as unknown_key:
        deployment.client("sk-wrong").chat.completions.create(**_chat())  # type: ignore[call-overload]
    assert unknown_key.value.response.headers["WWW-Authenticate"] == 'Bearer realm="polymorph"'  # before, none
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(**{**_chat(), "model": "no-such-model"})  # type: ignore[call-overload]
    with pytest.raises(openai.PermissionDeniedError, match="may not use model"):
        deployment.client(LIMITED_KEY).chat.completions.create(**{**_chat(), "model": "ghost-model"})  # type: ignore[call-overload]
    with pytest.raises(openai.PermissionDeniedError, match="Tier 'interactive' is not allowed"):
        deployment.client(LIMITED_KEY).chat.completions.create(**_chat(), extra_headers={"x-polymorph-tier": "interactive"})  # type: ignore[call-overload]
    with pytest.raises(openai.APIStatusError, match="exceeds the limit") as too_large:
        client.chat.completions.create(**_chat(text="x" * 70000))  # type: ignore[call-overload]
    assert too_large.value.status_code == 413


def test_malformed_json_gets_an_envelope_not_a_traceback(deployment: Deployment) -> None:
    request = urllib.request.Request(deployment.gateway.url + "/v1/chat/completions", data=b'{"model": ', headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    body = json.loads(info.value.read())
    info.value.close()
    assert info.value.code == 400 and body["error"]["code"] == "invalid_json" and "Traceback" not in body["error"]["message"]


def test_a_body_its_content_encoding_does_not_decode_gets_a_400_envelope(deployment: Deployment) -> None:
    """Before: a 500 'internal error' and a traceback in the log, on the OpenAI routes and the admin API alike."""
    for path, token in (("/v1/chat/completions", KEY), ("/admin/move", ADMIN)):
        for encoding in ("gzip", "deflate"):
            request = urllib.request.Request(deployment.gateway.url + path, data=b"not compressed", method="POST",
                                             headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                                                      "Content-Encoding": encoding})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=5)
            body = json.loads(info.value.read())
            info.value.close()
            assert (info.value.code, body["error"]["code"]) == (400, "invalid_body"), (path, encoding, body)
    # aiohttp meets the error again as it drains the rest of the body: one line in the log, not a traceback each
    wait_until("the drain's log line", lambda: "did not decode (answered 400)" in deployment.gateway.log(), 5)
    assert "Can not decode content-encoding" not in deployment.gateway.log()


def test_http_the_parser_refuses_gets_the_envelope_and_one_log_line(deployment: Deployment) -> None:
    """Requests aiohttp's parser refuses never reach the app. Before: aiohttp's own text/plain 400 (its 'Please
    install `Brotli`' for a br body), and a traceback each in the log."""
    port = int(deployment.gateway.url.rsplit(":", 1)[1])
    auth = ("Authorization", f"Bearer {KEY}")
    cases = {
        "oversized header": (raw_request("/v1/chat/completions", b"{}", [auth, ("X-Big", "a" * 20000)]), 400, "malformed_http"),
        "content-length and chunked": (raw_request("/v1/chat/completions", b"{}", [auth, ("Transfer-Encoding", "chunked")]), 400, "malformed_http"),
        "TLS on the HTTP port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400, "malformed_http"),
        "a broken chunk": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "malformed_http"),
        "br": (raw_request("/v1/chat/completions", b"{}", [auth, ("Content-Encoding", "br")]), 415, "unsupported_content_encoding"),
    }
    for label, (raw, status, code) in cases.items():
        answer = asyncio.run(send_raw(port, raw))
        assert answer is not None, label
        body = json.loads(answer.body)
        assert (answer.status, answer.headers["content-type"], body["error"]["code"]) == (status, "application/json", code), label
    assert "gzip, deflate" in body["error"]["message"] and answer.headers["accept-encoding"] == "gzip, deflate"  # RFC 9110 15.5.16
    wait_until("the log lines", lambda: deployment.gateway.log().count("rejected malformed HTTP request") >= len(cases) - 1, 5)
    assert "Traceback" not in deployment.gateway.log()


def test_rate_limit_is_429_with_retry_after(deployment: Deployment) -> None:
    client = deployment.client(LIMITED_KEY)
    for _ in range(2):
        client.chat.completions.create(**_chat(max_tokens=2))  # type: ignore[call-overload]
    with pytest.raises(openai.RateLimitError, match="requests per minute") as info:
        client.chat.completions.create(**_chat(max_tokens=2))  # type: ignore[call-overload]
    assert int(info.value.response.headers["Retry-After"]) >= 1


def test_unreachable_pool_is_ejected_and_answers_503_with_retry_after(deployment: Deployment) -> None:
    client = deployment.client()
    ghost = {**_chat(), "model": "ghost-model"}
    deadline = time.monotonic() + 5
    while True:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**ghost)  # type: ignore[call-overload]
        if info.value.status_code == 503:  # ejected by probes or failed requests: refused at once
            assert "no healthy replica" in info.value.message
            assert int(info.value.response.headers["Retry-After"]) >= 1
            break
        assert info.value.status_code == 502 and "could not be reached" in info.value.message
        assert time.monotonic() < deadline, "the dead replica was never ejected"


def test_hanging_replicas_give_504_not_a_hang(deployment: Deployment) -> None:
    for emulator in deployment.emulators:
        set_faults(emulator.url, hang_before_first_byte_s=5.0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError, match="did not answer") as info:
        deployment.client().chat.completions.create(**_chat())  # type: ignore[call-overload]
    assert info.value.status_code == 504
    assert time.monotonic() - started < 4.5  # two attempts of 1.5 s, not the replica's 5 s


def test_5xx_before_first_byte_is_retried_on_another_replica(deployment: Deployment) -> None:
    set_faults(deployment.emulators[0].url, error_rate=1.0, error_status=500)
    client = deployment.client()
    for _ in range(6):
        raw = client.chat.completions.with_raw_response.create(**_chat(max_tokens=3))  # type: ignore[call-overload]
        assert raw.parse().usage.completion_tokens == 3
        assert raw.headers["x-polymorph-replica"] == "main-1"


def test_crash_mid_stream_ends_with_an_sse_error(deployment: Deployment) -> None:
    for emulator in deployment.emulators:
        set_faults(emulator.url, crash_after_tokens=3, crash_mode="cut")
    stream = deployment.client().chat.completions.create(**_chat(max_tokens=50), stream=True)  # type: ignore[call-overload]
    received = []
    with pytest.raises(openai.APIError, match="broke off"):
        for chunk in stream:
            received.append(chunk)
    assert received  # the first tokens arrived before the error


def test_stalled_stream_times_out_with_an_sse_error(deployment: Deployment) -> None:
    for emulator in deployment.emulators:
        set_faults(emulator.url, stall_after_tokens=2, stall_s=5.0)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="upstream_stalled"):
        for _ in deployment.client().chat.completions.create(**_chat(max_tokens=20), stream=True):  # type: ignore[call-overload]
            pass
    assert time.monotonic() - started < 4.0


def _engine_running(emulator: Proc) -> float:
    with urllib.request.urlopen(emulator.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(r"^sglang:num_running_reqs(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M))


def _admin_state(deployment: Deployment) -> dict[str, object]:
    request = urllib.request.Request(deployment.gateway.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_client_disconnect_cancels_the_upstream_request(deployment: Deployment) -> None:
    for emulator in deployment.emulators:
        set_faults(emulator.url, slowdown=50.0)
    body = json.dumps({**_chat(max_tokens=4000), "stream": True}).encode()
    host, port = deployment.gateway.url.removeprefix("http://").split(":")
    before = _admin_state(deployment)["pools"][0]["replicas"]  # type: ignore[index]
    for _ in range(3):  # more than eject_after_failures: a client leaving must not count against a replica
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert b"200 OK" in sock.recv(65536)  # the stream has started
            assert sum(_engine_running(e) for e in deployment.emulators) == 1
            closed_at = time.monotonic()
        while sum(_engine_running(e) for e in deployment.emulators) > 0:
            assert time.monotonic() - closed_at < 2.0, "the replica kept generating for a gone client"
            time.sleep(0.01)
        assert time.monotonic() - closed_at < 0.25  # 100 ms target plus the /metrics polling cost
    after = _admin_state(deployment)["pools"][0]["replicas"]  # type: ignore[index]
    assert [(r["ejections"], r["health"]) for r in after] == [(r["ejections"], r["health"]) for r in before]
    time.sleep(0.5)  # the access log is flushed in batches
    lines = [json.loads(line) for line in deployment.gateway.log().splitlines() if line.startswith("{")]
    left = [line for line in lines if line.get("stream_error") == "client_disconnected"]
    assert len(left) == 3 and all(line["status"] == 200 and line["replica"] != "-" for line in left)  # recorded, as the client left them


def test_metrics_and_admin_state(deployment: Deployment) -> None:
    deployment.client().chat.completions.create(**_chat(max_tokens=2))  # type: ignore[call-overload]
    with urllib.request.urlopen(deployment.gateway.url + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert re.search(r'^polymorph_requests_total\{pool="main",status="200",tenant="main",tier="interactive"\} [1-9]', metrics, re.M)
    assert "polymorph_ttft_seconds_bucket" in metrics and KEY not in metrics
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(deployment.gateway.url + "/admin/state", timeout=5)
    assert denied.value.code == 401 and denied.value.headers["WWW-Authenticate"].startswith("Bearer")
    denied.value.close()
    state = _admin_state(deployment)
    assert [p["name"] for p in state["pools"]] == ["main", "dead"]
    assert {r["name"] for r in state["pools"][0]["replicas"]} == {"main-0", "main-1"}


def test_access_log_is_json_without_secrets(deployment: Deployment) -> None:
    deployment.client().chat.completions.create(**_chat(max_tokens=2, text="my secret prompt text"))  # type: ignore[call-overload]
    time.sleep(0.5)  # the log is flushed in batches
    lines = [json.loads(line) for line in deployment.gateway.log().splitlines() if line.startswith("{")]
    assert lines and all(KEY not in json.dumps(line) and "secret prompt" not in json.dumps(line) for line in lines)
    assert {"tenant", "tier", "pool", "replica", "status", "duration_ms"} <= set(lines[-1])


def test_invalid_reload_keeps_serving_and_valid_reload_applies(deployment: Deployment) -> None:
    tenant_file = deployment.tenants_dir / "main.yaml"
    good = tenant_file.read_text()
    tenant_file.write_text("name: main\napi_key_sha256: [not-a-hash]\n")
    time.sleep(1.5)
    assert "reload rejected" in deployment.gateway.log()
    deployment.client().chat.completions.create(**_chat(max_tokens=2))  # type: ignore[call-overload]
    tenant_file.write_text(good)
    write_tenant(deployment.tenants_dir, "newcomer", "sk-test-newcomer")
    deadline = time.monotonic() + 5
    while True:
        try:
            deployment.client("sk-test-newcomer").chat.completions.create(**_chat(max_tokens=2))  # type: ignore[call-overload]
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the valid reload was never applied"
            time.sleep(0.2)


def test_killed_replica_is_survived(tmp_path: Path) -> None:
    emulators = [start_emulator(tmp_path, f"k{i}") for i in range(2)]
    gateway = start_gateway(tmp_path, ["--upstream", emulators[0].url, "--upstream", emulators[1].url])
    with contextlib.ExitStack() as stack:
        stack.callback(gateway.stop)
        for emulator in emulators:
            stack.callback(emulator.stop)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-polymorph-demo", max_retries=0)
        stack.callback(client.close)
        (model,) = [m.id for m in client.models.list()]  # discovered from the replicas
        body = {**_chat(max_tokens=2), "model": model}
        client.chat.completions.create(**body)  # type: ignore[call-overload]
        emulators[0].kill()
        for _ in range(10):
            raw = client.chat.completions.with_raw_response.create(**body)  # type: ignore[call-overload]
            assert raw.headers["x-polymorph-replica"] == "default-1"


def test_workers_share_the_port_and_their_metrics(tmp_path: Path) -> None:
    emulator = start_emulator(tmp_path, "w0")
    gateway = start_gateway(tmp_path, ["--upstream", emulator.url, "--workers", "2"])
    with contextlib.ExitStack() as stack:
        stack.callback(emulator.stop)
        stack.callback(gateway.stop)
        children = Path(f"/proc/{gateway.process.pid}/task/{gateway.process.pid}/children").read_text().split()
        workers = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2
        for _ in range(20):  # a new connection each time, so the kernel spreads them over the workers
            with openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-polymorph-demo", max_retries=0) as client:
                model = client.models.list().data[0].id
                client.chat.completions.create(**{**_chat(max_tokens=1), "model": model})  # type: ignore[call-overload]
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert re.search(r'^polymorph_requests_total\{pool="default",status="200",tenant="demo",tier="standard"\} 20\.0$', metrics, re.M)
    assert gateway.process.returncode == 0


def test_openapi_document_lists_every_endpoint(deployment: Deployment) -> None:
    with urllib.request.urlopen(deployment.gateway.url + "/openapi.json", timeout=5) as resp:
        document = json.loads(resp.read())
    assert document["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/healthz", "/readyz", "/metrics", "/admin/state"} <= set(document["paths"])


def test_a_trickled_body_gets_408_not_a_held_connection(deployment: Deployment) -> None:
    host, port = deployment.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{".encode())
        started = time.monotonic()
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer
    assert 0.9 < time.monotonic() - started < 3.0
