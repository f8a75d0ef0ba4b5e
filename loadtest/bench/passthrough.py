"""The ceiling reference: the simplest correct aiohttp pass-through proxy (uvloop, orjson).

It reads the body, checks it is JSON (as any OpenAI proxy must, to learn ``stream``), forwards it
over one pooled ClientSession and returns the answer, streaming when the upstream streams. No
auth, classification or metrics: whatever the gateway adds costs rate relative to this.

Run: ``python -m loadtest.bench.passthrough --upstream http://127.0.0.1:8080 --port 8100``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence

import orjson
import uvloop
from aiohttp import ClientSession, TCPConnector, web

from kernels.argtypes import http_url, port

_FORWARDED_HEADERS = ("Content-Type", "Authorization", "Accept")
_SESSION_KEY = web.AppKey("session", ClientSession)


def build_app(upstream_url: str) -> web.Application:
    upstream_url = upstream_url.rstrip("/")

    async def open_session(app: web.Application) -> None:
        app[_SESSION_KEY] = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await app[_SESSION_KEY].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if body:
            try:
                orjson.loads(body)
            except orjson.JSONDecodeError:
                return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
        session = request.app[_SESSION_KEY]
        async with session.request(request.method, upstream_url + request.path_qs, data=body, headers=headers) as up:
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            response = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


async def serve(upstream_url: str, host: str, port: int) -> None:
    runner = web.AppRunner(build_app(upstream_url), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Minimal aiohttp pass-through proxy: the ceiling a Python proxy can reach.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--upstream", type=http_url, required=True, help="base URL to forward to, e.g. http://127.0.0.1:8080")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.upstream, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
