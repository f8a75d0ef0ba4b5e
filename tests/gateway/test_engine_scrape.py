"""Engine telemetry through a real gateway: each replica engine's /metrics read into the router's books,
re-exported at the gateway's /metrics and shown at /admin/state; unreadable engines are routed by the
gateway's own counts; a replica another client loads directly takes the gateway's new requests last."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from fleet.engines import install
from gateway.config import load_config
from gateway.engine_scrape import NOT_READ_YET
from kernels.yamlsrc import ConfigError
from tests.conftest import REPO, free_port
from tests.support.engines import llama_server
from tests.support.procs import Proc, running, start_emulator, start_gateway, write_tenant

KEY, ADMIN = "sk-test-engines", "admin-token-for-engine-tests"
EMULATED_MODEL = "llama-3.1-8b"
INTERVAL_S = 0.2
T = TypeVar("T")


def _eventually(check: Callable[[], T | None], what: str, timeout_s: float = 20.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _replicas_when(gateway: Proc, ready: Callable[[dict[str, dict[str, Any]]], object], what: str) -> dict[str, dict[str, Any]]:
    """/admin/state's replicas by name, once ``ready`` holds for them."""
    def check() -> dict[str, dict[str, Any]] | None:
        replicas = _replicas(gateway)
        return replicas if ready(replicas) else None
    return _eventually(check, what)


def _gateway(tmp: Path, pools: list[dict[str, Any]]) -> Proc:
    tenants = tmp / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 100000})
    config = {
        "server": {"host": "127.0.0.1", "admin_token": ADMIN},
        "upstream": {"engine_metrics_interval_s": INTERVAL_S, "health_interval_s": 0.5, "first_byte_timeout_s": 60},
        "tenants_dir": "tenants",
        "fleet": {"pools": pools},
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return start_gateway(tmp, ["--config", str(path)])


def _replicas(gateway: Proc) -> dict[str, dict[str, Any]]:
    request = urllib.request.Request(gateway.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        state = json.loads(resp.read())
    return {r["name"]: r for pool in state["pools"] for r in pool["replicas"]}


def _metric(gateway: Proc, name: str, pool: str, replica: str) -> float | None:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^{name}{{pool="{pool}",replica="{replica}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


@dataclass
class Emulated:
    gateway: Proc
    emulators: list[Proc]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulated]:
    tmp = tmp_path_factory.mktemp("engine-scrape")
    emulators = [start_emulator(tmp, f"emu{i}") for i in range(2)]
    pools = [
        {"name": "main", "model": EMULATED_MODEL, "shapes": ["short-chat", "long-context", "reasoning", "batch"], "replicas": {"urls": [e.url for e in emulators]}},
        {"name": "dead", "model": "ghost-model", "replicas": {"urls": [f"http://127.0.0.1:{free_port()}"]}},
        # an sglang-speaking engine declared as vLLM: its /metrics has none of vLLM's load metrics
        {"name": "mislabelled", "model": "other-model", "engine": {"kind": "vllm"}, "replicas": {"urls": [emulators[0].url]}},
    ]
    with running(*emulators):
        gateway = _gateway(tmp, pools)
        with running(gateway):
            yield Emulated(gateway, emulators)


def test_engine_figures_are_read_reexported_and_shown(emulated: Emulated) -> None:
    gateway = emulated.gateway
    # every replica read at least once (under load the three first scrapes land seconds apart)
    replicas = _replicas_when(gateway, lambda r: all(x["engine"] or x["engine_error"] not in (None, NOT_READ_YET) for x in r.values()),
                              "a scrape of every replica")
    main = replicas["main-0"]
    assert main["engine_kind"] == "emulated" and main["engine_error"] is None
    assert main["engine"]["num_running"] == 0 and main["engine"]["num_waiting"] == 0 and main["engine"]["foreign_requests"] == 0
    assert main["engine"]["kv_usage_fraction"] is not None
    assert replicas["dead-0"]["engine"] is None and "GET /metrics failed" in replicas["dead-0"]["engine_error"]
    mislabelled = replicas["mislabelled-0"]
    assert mislabelled["engine_kind"] == "vllm" and mislabelled["engine"] is None
    assert "no vllm load metrics" in mislabelled["engine_error"]

    assert _metric(gateway, "polymorph_engine_metrics_up", "main", "main-0") == 1.0
    assert _metric(gateway, "polymorph_engine_requests_running", "main", "main-0") == 0.0
    assert _metric(gateway, "polymorph_engine_requests_waiting", "main", "main-0") == 0.0
    assert _metric(gateway, "polymorph_engine_metrics_up", "dead", "dead-0") == 0.0
    assert _metric(gateway, "polymorph_engine_requests_running", "dead", "dead-0") is None  # unknown, not 0
    failures = _metric(gateway, "polymorph_engine_scrape_failures_total", "dead", "dead-0")
    assert failures is not None and failures >= 1
    _eventually(lambda: (_metric(gateway, "polymorph_engine_scrape_failures_total", "dead", "dead-0") or 0) > failures, "failures counted per scrape")

    # the same long prompt twice: the second finds it in the engine's prefix cache
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    document = " ".join(f"Clause {i} of the agreement binds the parties to term {i * 7}." for i in range(120))
    for _ in range(2):
        for _ in emulated.emulators:  # one request per replica and round, so each replica sees the prompt twice
            client.chat.completions.create(model=EMULATED_MODEL, messages=[{"role": "user", "content": document}], max_tokens=2)
    client.close()
    ratios = _eventually(lambda: [v for r in ("main-0", "main-1") if (v := _metric(gateway, "polymorph_engine_prefix_cache_hit_ratio", "main", r))],
                         "a prefix-cache hit ratio")
    assert all(0 < v <= 1 for v in ratios)


def test_an_engine_whose_metrics_stop_is_routed_by_the_gateways_own_counts(emulated: Emulated) -> None:
    gateway = emulated.gateway
    _eventually(lambda: _replicas(gateway)["main-1"]["engine"], "main-1's engine figures")
    emulated.emulators[1].kill()
    replica = _replicas_when(gateway, lambda r: r["main-1"]["engine"] is None, "main-1's figures going stale")["main-1"]
    assert "GET /metrics failed" in replica["engine_error"]
    assert _metric(gateway, "polymorph_engine_metrics_up", "main", "main-1") == 0.0
    assert _metric(gateway, "polymorph_engine_requests_running", "main", "main-1") is None


def test_a_bad_scrape_interval_names_file_line_and_field(tmp_path: Path) -> None:
    shutil.copy(REPO / "config.example.yaml", tmp_path / "config.yaml")
    shutil.copytree(REPO / "tenants", tmp_path / "tenants")
    path = tmp_path / "config.yaml"
    path.write_text(path.read_text().replace("  max_attempts: 3", "  engine_metrics_interval_s: 0\n  max_attempts: 3", 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.file.endswith("config.yaml") and err.field == "upstream.engine_metrics_interval_s"
    assert err.line == next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "engine_metrics_interval_s: 0" in line)
    assert "between" in err.reason


def test_a_replica_another_client_loads_directly_gets_the_gateways_new_requests_last(tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    # two llama-servers of two slots each; a client keeps A busy with four long generations of its own
    with llama_server(llama_server_bin, tiny_gguf, "--metrics", "--parallel", "2", log_path=tmp_path / "a.log") as a, \
         llama_server(llama_server_bin, tiny_gguf, "--metrics", "--parallel", "2", log_path=tmp_path / "b.log") as b:
        pools = [{"name": "cpu", "model": install.TINY_MODEL, "engine": {"kind": "llamacpp"}, "replicas": {"urls": [a.url, b.url]}}]
        gateway = _gateway(tmp_path, pools)
        with running(gateway):
            _eventually(lambda: all(r["engine"] for r in _replicas(gateway).values()), "both engines' figures")
            assert {r["engine_kind"] for r in _replicas(gateway).values()} == {"llamacpp"}
            direct = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=120)
            stop = threading.Event()
            loaders = [threading.Thread(target=_generate_long, args=(direct, stop)) for _ in range(4)]
            for thread in loaders:
                thread.start()
            try:
                busy = _replicas_when(gateway, lambda r: r["cpu-0"]["engine"]["num_running"] + r["cpu-0"]["engine"]["num_waiting"] >= 3,
                                      "the direct load in A's scraped figures")["cpu-0"]
                assert busy["engine"]["foreign_requests"] >= 3 and busy["in_flight"] == 0
                client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
                chosen = []
                for i in range(3):
                    raw = client.chat.completions.with_raw_response.create(
                        model=install.TINY_MODEL, messages=[{"role": "user", "content": f"Say hello, number {i}."}], max_tokens=4)
                    raw.parse()
                    chosen.append(raw.headers["x-polymorph-replica"])
                client.close()
                assert chosen == ["cpu-1"] * 3
            finally:
                stop.set()
                for thread in loaders:
                    thread.join(timeout=180)
                direct.close()


def _generate_long(client: openai.OpenAI, stop: threading.Event) -> None:
    """A long generation, streamed until ``stop`` (closing the stream makes llama-server drop it)."""
    stream = client.completions.create(model=install.TINY_MODEL, prompt="Once upon a time", max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    with stream:
        for _ in stream:
            if stop.is_set():
                return
