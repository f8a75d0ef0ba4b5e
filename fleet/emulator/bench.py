"""`polymorph bench emulator`: concurrent streams one emulator process serves before its timing drifts.

The emulator runs in a subprocess at --speed 1; this process is the client. For each concurrency
level N it opens N streaming chat requests at once (``ignore_eos``, fixed length), reads them to the
end, and asks the emulator how its busy wall time compared with the engine's planned iteration
times (``/_emulator/stats`` timing). Drift above the threshold means the event loop could not keep
up and tokens reach clients slower than the modelled GPU would send them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import orjson

from fleet.actuators.local import free_port


def start_emulator(model: str, gpu: str, port: int, config: dict[str, Any], extra: list[str] | None = None,
                   log_path: str = os.devnull, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
    """Launch `polymorph emulate` (output to ``log_path``) and wait until it answers /health."""
    command = [sys.executable, "-m", "gateway.cli", "emulate", "--model", model, "--gpu", gpu, "--port", str(port),
               "--config", json.dumps(config), *(extra or [])]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"emulator exited with {process.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    process.wait()
    raise RuntimeError(f"emulator did not listen on port {port} within {timeout_s} s")


async def _one_stream(session: aiohttp.ClientSession, url: str, num_tokens: int, index: int) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": f"request {index}: tell me a story"}],
            "max_tokens": num_tokens, "ignore_eos": True, "stream": True}
    num_chunks = 0
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                num_chunks += 1
    return num_chunks


async def _level(base: str, concurrency: int, num_tokens: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{base}/_emulator/stats?reset_timing=1") as response:
            await response.read()
        started = time.monotonic()
        await asyncio.gather(*(_one_stream(session, f"{base}/v1/chat/completions", num_tokens, i) for i in range(concurrency)))
        elapsed_s = time.monotonic() - started
        async with session.get(f"{base}/_emulator/stats") as response:
            timing = (await response.json())["timing"]
    return {"concurrency": concurrency, "drift": timing["drift"], "p99_late_ms": timing["p99_late_ms"],
            "iterations": timing["num_iterations"], "tok_s": round(concurrency * num_tokens / elapsed_s, 1),
            "elapsed_s": round(elapsed_s, 2)}


def main_bench(args: argparse.Namespace) -> int:
    levels = [int(level) for level in args.concurrency.split(",") if level.strip()]
    port = free_port()
    config = {"max_running_requests": max(levels) * 2}
    process = start_emulator(args.model, args.gpu, port, config)
    results: list[dict[str, Any]] = []
    try:
        for level in levels:
            results.append(asyncio.run(_level(f"http://127.0.0.1:{port}", level, args.tokens)))
    finally:
        process.terminate()
        process.wait(timeout=10)
    print(f"{'streams':>8} {'drift':>8} {'p99 late ms':>12} {'iterations':>11} {'tok/s':>9}")
    for row in results:
        print(f"{row['concurrency']:>8} {row['drift']:>8.3f} {row['p99_late_ms']:>12.2f} {row['iterations']:>11} {row['tok_s']:>9.0f}")
    within = [row["concurrency"] for row in results if row["drift"] <= args.max_drift]
    print(json.dumps({
        "bench": "emulator", "model": args.model, "gpu": args.gpu, "speed": 1.0, "tokens_per_stream": args.tokens,
        "max_drift": args.max_drift, "max_concurrent_streams_within_drift": max(within) if within else 0,
        "levels": results,
    }))
    return 0
