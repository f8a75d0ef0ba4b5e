"""Hostile clients: malformed and oversized requests, header tricks, trickling bodies, schema fuzzing.

Each request goes over a raw socket so nothing is tidied up on the way. Every answer must be a 4xx
with the OpenAI error envelope, those to requests aiohttp's HTTP parser refuses before the app sees them
(oversized header lines, smuggling attempts) included.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from fleet.engines.install import QUIET_ENV, InstallError, Progress, cache_dir, pip_venv
from loadtest.chaos.report import Check, ScenarioResult
from loadtest.chaos.stack import ChaosStack

# schemathesis 4's command line (--phases, --no-shrink, --workers, --request-timeout in seconds), pinned.
SCHEMATHESIS_REQUIREMENT = "schemathesis==4.32.5"
_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/state", "/metrics", "/healthz", "/nope")


@dataclass(frozen=True, slots=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_request(path: str, body: bytes, headers: list[tuple[str, str]], method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gw", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}", "Connection: close"]
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


async def send_raw(port: int, raw: bytes, timeout_s: float = 10.0) -> RawAnswer | None:
    """Send bytes, read the answer to the close; None when no HTTP answer came back."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(raw)
                data = await reader.read(-1)
            finally:
                writer.close()
    except (TimeoutError, OSError):
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if match is None:
        return None
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return RawAnswer(int(match.group(1)), headers, body)


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return bytes(out)
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        pos = end + 4 + size


def has_envelope(body: bytes) -> bool:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "code" in error and "type" in error


def judge(answer: RawAnswer | None) -> str:
    """'ok' or the reason the answer breaks the promise."""
    if answer is None:
        return "no HTTP answer"
    if answer.status == 200:
        return "ok"
    if 400 <= answer.status < 500:
        return "ok" if has_envelope(answer.body) else "4xx without the envelope"
    return f"HTTP {answer.status}" + ("" if has_envelope(answer.body) else " without the envelope")


def _nested(depth: int) -> bytes:
    return b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"


def hostile_corpus(api_key: str, model: str, max_body_bytes: int, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(label, raw request) pairs: a fixed list of known-nasty inputs, then seeded random mutations."""
    auth = ("Authorization", f"Bearer {api_key}")
    json_type = ("Content-Type", "application/json")
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    fixed: list[tuple[str, bytes, list[tuple[str, str]]]] = [
        ("truncated json", b'{"model": ', [auth, json_type]),
        ("json array", b"[1,2,3]", [auth, json_type]),
        ("invalid utf-8", b'{"model": "\xff\xfe", "messages": []}', [auth, json_type]),
        ("huge integer", b'{"model":"%s","messages":[{"role":"user","content":"x"}],"max_tokens":%s}' % (model.encode(), b"9" * 400), [auth, json_type]),
        ("huge float", b'{"model":"%s","messages":[{"role":"user","content":"x"}],"temperature":1e999}' % model.encode(), [auth, json_type]),
        ("nan", b'{"model":"%s","messages":[{"role":"user","content":"x"}],"temperature":NaN}' % model.encode(), [auth, json_type]),
        ("deep nesting", _nested(100000), [auth, json_type]),
        ("content parts of wrong types", orjson.dumps({**good, "messages": [{"role": "user", "content": [{"type": "text", "text": 7}, {"text": None}, {}]}]}), [auth, json_type]),
        ("content part text nested", orjson.dumps({**good, "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": [1]}}]}]}), [auth, json_type]),
        ("tools of wrong type", orjson.dumps({**good, "tools": "rm -rf"}), [auth, json_type]),
        ("prompt of mixed list", orjson.dumps({"model": model, "prompt": ["a", 1, None]}), [auth, json_type]),
        ("prompt token ids huge", orjson.dumps({"model": model, "prompt": [2**63 - 1, -5], "max_tokens": 1}), [auth, json_type]),
        ("oversized body", b'{"model":"' + b"a" * (max_body_bytes + 10) + b'"}', [auth, json_type]),
        ("oversized header", b"{}", [auth, ("X-Big", "a" * 20000)]),
        ("many headers", b"{}", [auth, *((f"X-H{i}", "v") for i in range(300))]),
        ("duplicate authorization", orjson.dumps(good), [("Authorization", "Bearer wrong-key"), auth, json_type]),
        ("crlf in tier header value", orjson.dumps(good), [auth, ("x-polymorph-tier", "batch\rSet-Cookie: x=1")]),
        ("tier above allowed", orjson.dumps(good), [auth, ("x-polymorph-tier", "x" * 5000)]),
        ("bearer with nul", orjson.dumps(good), [("Authorization", "Bearer \x00\x01"), json_type]),
        ("basic auth", orjson.dumps(good), [("Authorization", "Basic dXNlcjpwYXNz"), json_type]),
        ("content-length and chunked", orjson.dumps(good), [auth, ("Transfer-Encoding", "chunked")]),
        ("admin with tenant key", b"", [auth]),
    ]
    for label, body, headers in fixed:
        path = "/admin/state" if label.startswith("admin") else "/v1/chat/completions"
        yield label, raw_request(path, body, headers, "GET" if path == "/admin/state" else "POST")
    rng = random.Random(seed)
    base = orjson.dumps(good)
    for i in range(10**9):
        mutated = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(mutated))
            mutated[at] = rng.randrange(256)
        path = rng.choice(_PATHS)
        method = rng.choice(("POST", "POST", "GET", "PUT", "DELETE"))
        yield f"mutation {i}", raw_request(path, bytes(mutated), [auth, json_type], method)


async def trickle(port: int, raw: bytes, hold_s: float) -> float:
    """Send ``raw`` minus its last byte, one byte every 0.2 s; returns how long the gateway kept it open."""
    started_at = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0.0
    try:
        cut = raw.index(b"\r\n\r\n") + 4
        writer.write(raw[:cut])
        for byte in raw[cut : cut + int(hold_s / 0.2)]:
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    return time.monotonic() - started_at


def schemathesis_bin(progress: Progress | None = None) -> Path:
    """schemathesis in a venv of its own under the project's cache, installed on first use."""
    python = pip_venv(cache_dir() / "schemathesis-venv", (SCHEMATHESIS_REQUIREMENT,), "schemathesis.cli", progress)
    return python.parent / "schemathesis"


def run_schemathesis(base_url: str, api_key: str, max_examples: int, seed: int, timeout_s: float) -> tuple[int | None, str]:
    """(exit code, output tail) of schemathesis against GET /openapi.json; (None, why) if it cannot be installed."""
    try:
        binary = schemathesis_bin()
    except InstallError as problem:
        return None, str(problem)
    argv = [str(binary), "run", f"{base_url}/openapi.json", "--max-examples", str(max_examples), "--seed", str(seed),
            "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            "--header", f"Authorization: Bearer {api_key}", "--phases", "examples,fuzzing", "--no-shrink",
            "--request-timeout", "10", "--workers", "2"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}, **QUIET_ENV}
    for _ in range(2):  # hypothesis on CPython 3.11 can trip over its own lambda introspection (SystemError): once more
        try:
            done = subprocess.run(argv, capture_output=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return 1, f"schemathesis ran past {timeout_s:g} s"
        output = (done.stdout + done.stderr).decode(errors="replace")
        if "SystemError: AST constructor recursion depth mismatch" not in output:
            break
    return done.returncode, output[-3000:]


async def hostile_input(stack: ChaosStack, api_key: str, model: str, num_requests: int, num_tricklers: int) -> ScenarioResult:
    """The corpus, with tricklers holding connections meanwhile; then the gateway must be healthy and its log clean."""
    port = stack.gateway_port
    trickling = [asyncio.create_task(trickle(port, raw_request("/v1/chat/completions", b'{"model": "' + b"x" * 100 + b'"}', [("Authorization", f"Bearer {api_key}")]), 3.0))
                 for _ in range(num_tricklers)]
    verdicts: list[str] = []
    loop = asyncio.get_running_loop()
    slowest_s = 0.0
    for _, raw in itertools.islice(hostile_corpus(api_key, model, stack.plan.max_body_bytes), num_requests):
        sent_at = loop.time()
        verdicts.append(judge(await send_raw(port, raw)))
        slowest_s = max(slowest_s, loop.time() - sent_at)
    held_s = await asyncio.gather(*trickling)
    healthy = (await send_raw(port, raw_request("/healthz", b"", [], "GET")) or RawAnswer(0, {}, b"")).status == 200
    await asyncio.sleep(0.5)  # the access log is flushed in batches
    log = stack.gateway_log()
    leaked = [s for s in (api_key, stack.plan.admin_token) if s in log]
    bad = [v for v in verdicts if v != "ok"]
    checks = [
        Check("every answer is a 4xx envelope", not bad, f"{len(bad)}: {sorted(set(bad))[:3]}"),
        Check("gateway healthy after", healthy and stack.gateway_alive(), "/healthz failed"),
        Check("no secret in the gateway's log", not leaked, "an API key or admin token was logged"),
        Check("answers quick while tricklers hold connections (< 1 s)", slowest_s < 1.0, f"slowest {slowest_s:.2f} s"),
    ]
    figures = {"tricklers": float(num_tricklers),
               "trickler_held_s": max(held_s, default=0.0), "slowest_answer_ms": slowest_s * 1000}
    return ScenarioResult("hostile-input", len(verdicts), verdicts.count("ok"), 0, 0, len(bad), 0.0, tuple(checks), figures, tuple(bad))
