"""One engine, two clocks: the same load through the gateway to emulated replicas on two GPU kinds
gives, from the client, the TTFT and TPOT that `kernels predict` computes for that load (within 15%).

One client at a time pins both figures: its arrivals are the prediction's arrivals. Eight clients in a
closed loop pin TPOT at a batch of eight, but not TTFT: the prediction sends each wave at one instant
and prefills it as one batch, while real clients' next requests reach the engine a few milliseconds apart,
so the first of a wave starts its prefill alone and the wave's mean TTFT falls (measured 0.82-0.93x of the
prediction, and CI once failed the old 15% bound at 0.82x). There the test asks for what the phase cannot
change: TTFT between one request's prefill and the whole wave's.
"""

from __future__ import annotations

import asyncio
import json
import time
from itertools import count
from pathlib import Path

import aiohttp
import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import PerfModel
from kernels.predict import Prediction, Workload, predict
from tests.support.procs import start_emulator, start_gateway, write_tenant

# Real time (speed 1): the gateway's and the emulator's per-chunk cost (about 0.5 ms a token here) is not sped up,
# so at speed 2 it was 14-17% of a 3.2 ms real TPOT and the run sat on the 15% bound (failed 2 of 3 on an idle
# machine); at speed 1 the same load measured +4-7%. The lone client's 4000-token prompt makes the gateway's
# own ~4 ms a small part of its TTFT (+8.5% on a 1000-token prompt).
SPEED = 1.0
LONE = Workload(4000, 64, concurrency=1, num_requests=6)
WAVES = Workload(1000, 64, concurrency=8, num_requests=40)
KEY = "sk-test-predict"
# Every prompt starts with its own token, so no request (in any load, on either engine) hits another's prefix cache.
_FIRST_TOKENS = count(2)


async def _closed_loop(url: str, model: str, load: Workload) -> tuple[float, float]:
    """Mean TTFT and TPOT (seconds, scaled back to real time) of `load.concurrency` clients in a closed loop."""
    assert load.concurrency is not None and load.num_requests is not None
    ttfts: list[float] = []
    tpots: list[float] = []
    counter = iter(range(load.num_requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in counter:
            body = {"model": model, "prompt": [next(_FIRST_TOKENS)] + [1] * (load.isl - 1), "max_tokens": load.osl, "ignore_eos": True,
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
            assert completion_tokens == load.osl
            ttfts.append((first_at - sent_at) * SPEED)
            tpots.append((last_at - first_at) / (load.osl - 1) * SPEED)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(load.concurrency)))
    return sum(ttfts) / len(ttfts), sum(tpots) / len(tpots)


def _predicted(gpu: str, load: Workload) -> Prediction:
    return predict(PerfModel(get_model("llama-3.1-8b"), get_gpu(gpu), EngineConfig()), load)


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
            ttft, tpot = asyncio.run(_closed_loop(gateway.url, f"llama-{name}", LONE))
            lone = _predicted(gpu, LONE)
            assert tpot == pytest.approx(lone.tpot_mean_s, rel=0.15), (name, "lone", tpot, lone)
            assert ttft == pytest.approx(lone.ttft_mean_s, rel=0.15), (name, "lone", ttft, lone)

            ttft, tpot = asyncio.run(_closed_loop(gateway.url, f"llama-{name}", WAVES))
            waves = _predicted(gpu, WAVES)
            one_prefill = _predicted(gpu, Workload(WAVES.isl, WAVES.osl, concurrency=1, num_requests=4))
            assert tpot == pytest.approx(waves.tpot_mean_s, rel=0.15), (name, "waves", tpot, waves)
            assert one_prefill.ttft_mean_s < ttft < waves.ttft_mean_s * 1.15, (name, "waves", ttft, one_prefill, waves)
    finally:
        gateway.stop()
        for emulator in emulators.values():
            emulator.stop()
