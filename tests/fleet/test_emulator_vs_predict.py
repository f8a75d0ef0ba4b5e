"""One engine, two clocks: the same load through the gateway to emulated replicas on two GPU kinds
gives, from the client, the TTFT and TPOT that `kernels predict` computes for that load (within 15%).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import PerfModel
from kernels.predict import Workload, predict
from tests.support.procs import start_emulator, start_gateway, write_tenant

# Real time (speed 1): the gateway's and the emulator's per-chunk cost (about 0.5 ms a token here) is not sped up,
# so at speed 2 it was 14-17% of a 3.2 ms real TPOT and the run sat on the 15% bound (failed 2 of 3 on an idle
# machine); at speed 1 the same load measured +8%.
ISL, OSL, CONCURRENCY, NUM_REQUESTS, SPEED = 1000, 64, 8, 40, 1.0
KEY = "sk-test-predict"


async def _closed_loop(url: str, model: str) -> tuple[float, float]:
    """Mean TTFT and TPOT (seconds, scaled back to real time) of CONCURRENCY clients in a closed loop."""
    ttfts: list[float] = []
    tpots: list[float] = []
    counter = iter(range(NUM_REQUESTS))

    async def client(session: aiohttp.ClientSession) -> None:
        for i in counter:
            body = {"model": model, "prompt": [i + 2] + [1] * (ISL - 1), "max_tokens": OSL, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent_at = time.perf_counter()
            first_at = last_at = 0.0
            completion_tokens = 0
            async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                        last_at = time.perf_counter()
                        first_at = first_at or last_at
                    if chunk.get("usage"):
                        completion_tokens = chunk["usage"]["completion_tokens"]
            assert completion_tokens == OSL
            ttfts.append((first_at - sent_at) * SPEED)
            tpots.append((last_at - first_at) / (OSL - 1) * SPEED)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
    return sum(ttfts) / len(ttfts), sum(tpots) / len(tpots)


@pytest.mark.slow
@pytest.mark.serial
def test_emulated_replicas_match_the_prediction(tmp_path: Path) -> None:
    gpus = {"h100": "H100-SXM", "h200": "H200"}
    emulators = {name: start_emulator(tmp_path, name, gpu=gpu, speed=SPEED, extra=["--served-model-name", f"llama-{name}"]) for name, gpu in gpus.items()}
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "bench", KEY, max_concurrency=1000)
    pools = [{"name": name, "model": f"llama-{name}", "replicas": {"urls": [emulators[name].url]}} for name in gpus]
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"tenants_dir": "tenants", "fleet": {"pools": pools}, "server": {"access_log": False}}))
    gateway = start_gateway(tmp_path, ["--config", str(config)])
    try:
        for name, gpu in gpus.items():
            measured_ttft, measured_tpot = asyncio.run(_closed_loop(gateway.url, f"llama-{name}"))
            perf = PerfModel(get_model("llama-3.1-8b"), get_gpu(gpu), EngineConfig())
            predicted = predict(perf, Workload(ISL, OSL, concurrency=CONCURRENCY, num_requests=NUM_REQUESTS))
            assert measured_tpot == pytest.approx(predicted.tpot_mean_s, rel=0.15), (name, measured_tpot, predicted)
            assert measured_ttft == pytest.approx(predicted.ttft_mean_s, rel=0.15), (name, measured_ttft, predicted)
    finally:
        gateway.stop()
        for emulator in emulators.values():
            emulator.stop()
