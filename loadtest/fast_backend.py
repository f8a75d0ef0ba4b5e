"""A minimal, fast OpenAI-compatible stub server for measuring clients (load generator, gateway).

It answers ``/v1/chat/completions`` (streamed or not) with ``max_tokens`` placeholder tokens after
optional fixed delays, ``/v1/models``, ``/health``, and, when given a file, ``/admin/decisions``.
It models no GPU: use the emulator (``polymorph emulate``) for that. Run it with
``polymorph loadtest fast-backend --port 8001`` (its options are loadtest.cli's, so that ``polymorph
--help`` imports no server code), or from Python with ``fast_backend_process()``, which runs that
command in a subprocess for the length of a block.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from aiohttp import web

from classifiers.tokens import count_chat_tokens
from loadtest import procs

_TOKEN = "tok "
COMMAND = (sys.executable, "-m", "gateway.cli", "loadtest", "fast-backend")  # `polymorph loadtest fast-backend`
_START_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    model: str = "fast-backend"
    ttft_s: float = 0.0  # delay before the first token
    itl_s: float = 0.0  # delay between tokens (streamed) or per extra token (not streamed)
    max_output_tokens: int = 4096
    routing_headers: bool = False  # answer with x-polymorph-* headers, as a Polymorph gateway would
    decisions_path: Path | None = None  # served at /admin/decisions (404 when None)


def _routing_headers(config: BackendConfig) -> dict[str, str]:
    if not config.routing_headers:
        return {}
    return {"x-polymorph-pool": "fast-pool", "x-polymorph-replica": "fast-0", "x-polymorph-shape": "short-chat"}


def _chunk(created: int, model: str, delta: dict[str, str], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-fast",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    config: BackendConfig = request.app["config"]
    try:
        body = orjson.loads(await request.read())
        messages = body["messages"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return web.json_response({"error": {"message": "body must be JSON with messages"}}, status=400)
    num_output = max(1, min(int(body.get("max_tokens") or 16), config.max_output_tokens))
    usage = {
        "prompt_tokens": count_chat_tokens(messages),
        "completion_tokens": num_output,
        "total_tokens": 0,
    }
    usage["total_tokens"] = usage["prompt_tokens"] + num_output
    created = int(time.time())
    if config.ttft_s > 0:
        await asyncio.sleep(config.ttft_s)
    if not body.get("stream"):
        if config.itl_s > 0:
            await asyncio.sleep(config.itl_s * (num_output - 1))
        answer = {
            "id": "chatcmpl-fast",
            "object": "chat.completion",
            "created": created,
            "model": config.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": _TOKEN * num_output},
                         "finish_reason": "length"}],
            "usage": usage,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json",
                            headers=_routing_headers(config))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **_routing_headers(config)})
    await response.prepare(request)
    await response.write(_chunk(created, config.model, {"role": "assistant"}))
    for index in range(num_output):
        if index and config.itl_s > 0:
            await asyncio.sleep(config.itl_s)
        await response.write(_chunk(created, config.model, {"content": _TOKEN}))
    await response.write(_chunk(created, config.model, {}, "length"))
    if (body.get("stream_options") or {}).get("include_usage"):
        tail = {"id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": created,
                "model": config.model, "choices": [], "usage": usage}
        await response.write(b"data: " + orjson.dumps(tail) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    model = request.app["config"].model
    return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "loadtest"}]})


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _decisions(request: web.Request) -> web.Response:
    path = request.app["config"].decisions_path
    if path is None:
        raise web.HTTPNotFound()
    return web.Response(body=path.read_bytes(), content_type="application/x-ndjson")


def make_app(config: BackendConfig) -> web.Application:
    app = web.Application()
    app["config"] = config
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/admin/decisions", _decisions)
    return app


def config_from_args(args: argparse.Namespace) -> BackendConfig:
    return BackendConfig(
        model=args.model,
        ttft_s=args.ttft_ms / 1000,
        itl_s=args.itl_ms / 1000,
        routing_headers=args.routing_headers,
        decisions_path=args.decisions,
    )


def serve(args: argparse.Namespace) -> int:
    import uvloop

    loop = uvloop.new_event_loop()
    print(f"fast backend on http://{args.host}:{args.port}", flush=True)
    web.run_app(
        make_app(config_from_args(args)),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=loop,
        shutdown_timeout=1.0,
    )
    loop.close()
    return 0


@contextmanager
def fast_backend_process(port: int | None = None, *extra_args: str) -> Iterator[str]:
    """Run the fast backend (``COMMAND``) in a subprocess; yields its base URL once it answers /health."""
    port = port or procs.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*COMMAND, "--port", str(port), *extra_args]
    with tempfile.TemporaryDirectory(prefix="polymorph-fast-backend-") as log_dir:  # its output, for a failed start's error
        process = procs.start_healthy(argv, f"{url}/health", Path(log_dir) / "fast-backend.log", _START_TIMEOUT_S,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield url
        finally:
            procs.stop(process)
