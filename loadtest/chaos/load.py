"""The chaos client: sends requests and judges each answer as succeeded, failed clearly, or lost.

Lost is what must never happen: no answer, a connection reset with no error, a stream that stops
without ``[DONE]`` or an error event, a body that is not the promised JSON, or an answer later than
the client's deadline (which is set from the gateway's own timeouts, so "hung" counts as lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

OK, CLEAR, LOST = "succeeded", "failed_clear", "lost"


@dataclass(frozen=True, slots=True)
class Request:
    path: str
    body: bytes
    stream: bool
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Answer:
    verdict: str  # OK, CLEAR or LOST
    status: int
    latency_s: float
    detail: str  # the error code of a clear failure, the reason of a lost one, the pool of a success
    sent_at: float  # seconds since the load started
    retry_after: bool  # a Retry-After header came with it


def chat_request(model: str, api_key: str, max_tokens: int, stream: bool, text: str = "Say hello to the team.",
                 extra_headers: Mapping[str, str] | None = None) -> Request:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", **(extra_headers or {})}
    return Request("/v1/chat/completions", orjson.dumps(body), stream, headers)


def _envelope_code(raw: bytes) -> str | None:
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("message") and "code" in error:
        return str(error["code"])
    return None


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    saw_done = False
    error_code: str | None = None
    async for line in resp.content:
        if line.startswith(b"data: [DONE]"):
            saw_done = True
        elif line.startswith(b'data: {"error"'):
            error_code = _envelope_code(line[6:]) or "unparseable_error_event"
    if error_code is not None:
        return CLEAR, error_code
    if saw_done:
        return OK, resp.headers.get("x-polymorph-pool", "-")
    return LOST, "the stream ended without [DONE] or an error event"


class ChaosClient:
    """One aiohttp session against the gateway; ``deadline_s`` is the longest a correct answer may take."""

    def __init__(self, base_url: str, deadline_s: float) -> None:
        self.base_url = base_url
        self.deadline_s = deadline_s
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChaosClient:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(self, request: Request, started_at: float) -> Answer:
        assert self.session is not None
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        status, retry_after = 0, False
        try:
            async with asyncio.timeout(self.deadline_s):
                async with self.session.post(self.base_url + request.path, data=request.body, headers=request.headers) as resp:
                    status, retry_after = resp.status, "Retry-After" in resp.headers
                    if status == 200 and request.stream:
                        verdict, detail = await _read_stream(resp)
                    else:
                        raw = await resp.read()
                        verdict, detail = _judge_body(status, raw, resp.headers.get("x-polymorph-pool", "-"))
        except TimeoutError:
            verdict, detail = LOST, f"no complete answer within {self.deadline_s:g} s"
        except (aiohttp.ClientError, ConnectionError) as exc:
            verdict, detail = LOST, f"connection failed: {type(exc).__name__}"
        return Answer(verdict, status, loop.time() - sent_at, detail, sent_at - started_at, retry_after)


def _judge_body(status: int, raw: bytes, pool: str) -> tuple[str, str]:
    if status == 200:
        try:
            ok = "choices" in orjson.loads(raw)
        except orjson.JSONDecodeError:
            ok = False
        return (OK, pool) if ok else (LOST, "a 200 whose body is not a completion")
    code = _envelope_code(raw)
    if code is None:
        return LOST, f"HTTP {status} without the error envelope"
    return CLEAR, code


async def open_loop(client: ChaosClient, make: Callable[[int], Request], rate_rps: float, duration_s: float,
                    until: asyncio.Event | None = None) -> list[Answer]:
    """Send at a fixed rate regardless of answers (overload stays overload) for ``duration_s`` or until
    ``until`` is set; wait for every answer."""
    loop = asyncio.get_running_loop()
    started_at = loop.time()
    tasks: list[asyncio.Task[Answer]] = []
    num = int(rate_rps * duration_s)
    for i in range(num):
        delay = started_at + i / rate_rps - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if until is not None and until.is_set():
            break
        tasks.append(loop.create_task(client.send(make(i), started_at)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(client: ChaosClient, make: Callable[[int], Request], concurrency: int, num_requests: int) -> list[Answer]:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    started_at = asyncio.get_running_loop().time()
    answers: list[Answer] = []
    counter = iter(range(num_requests))

    async def worker() -> None:
        for i in counter:
            answers.append(await client.send(make(i), started_at))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
