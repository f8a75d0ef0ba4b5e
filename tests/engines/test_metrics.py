"""Engines' /metrics text into EngineLoad: each kind's names, label sets, older names, missing figures.

vLLM and sglang render their metrics with prometheus_client; their texts here are rendered the same way,
from registries that declare those engines' metric names, types and labels (with histograms, which make
most of a real scrape). The emulated replica's and llama-server's texts are read from running processes.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from fleet.engines import install
from fleet.engines.load import EngineLoad
from fleet.engines.metrics import parse_load, prefix_hit_fraction
from tests.support.engines import llama_server
from tests.support.procs import running, start_emulator

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def vllm_text(engines: dict[str, tuple[int, int, float]], old_names: bool = False) -> str:
    """A vLLM v1 scrape: per data-parallel engine (label ``engine``) running, waiting, KV use; counters
    prompt 1000, hits 400 per engine; its latency and length histograms observed a few times."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.", [*labels, "reason"], registry=r)
    kv = Gauge("vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
    prefix = "vllm:gpu_prefix_cache" if old_names else "vllm:prefix_cache"
    queries = Counter(f"{prefix}_queries", "Prefix cache queries, in terms of number of queried tokens.", labels, registry=r)
    hits = Counter(f"{prefix}_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
    generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r)
    Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r)
    success = Counter("vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"], registry=r)
    histograms = [
        Histogram(f"vllm:{name}", name, labels, buckets=_LATENCY_BUCKETS, registry=r)
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
    ] + [
        Histogram(f"vllm:{name}", name, labels, buckets=_TOKEN_BUCKETS, registry=r)
        for name in ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total", "request_max_num_generation_tokens", "request_params_max_tokens")
    ]
    for engine, (num_running, num_waiting, kv_fraction) in engines.items():
        values = ("tiny-llama", engine)
        running.labels(*values).set(num_running)
        waiting.labels(*values).set(num_waiting)
        by_reason.labels(*values, "capacity").set(num_waiting)  # a name that extends waiting's: not counted again
        kv.labels(*values).set(kv_fraction)
        queries.labels(*values).inc(1000)
        hits.labels(*values).inc(400)
        prompt.labels(*values).inc(1000)
        generation.labels(*values).inc(250)
        success.labels(*values, "stop").inc(3)
        for histogram in histograms:
            for value in (0.03, 0.3, 3.0, 30.0):
                histogram.labels(*values).observe(value)
    return generate_latest(r).decode()


def sglang_text(ranks: list[tuple[str, str, int, int]]) -> str:
    """An sglang scrape with one series per (dp_rank, tp_rank) scheduler: running, waiting; token_usage
    0.25; counters prompt 800 and cached 200 per series; a queue gauge whose name extends running's."""
    r = CollectorRegistry()
    labels = ["model_name", "engine_type", "dp_rank", "tp_rank", "pp_rank"]
    gauges = {name: Gauge(f"sglang:{name}", name, labels, registry=r) for name in (
        "num_running_reqs", "num_queue_reqs", "num_running_reqs_offline_batch", "num_used_tokens", "token_usage",
        "gen_throughput", "cache_hit_rate", "num_grammar_queue_reqs", "utilization")}
    counters = {name: Counter(f"sglang:{name}", name, labels, registry=r) for name in ("prompt_tokens", "generation_tokens", "cached_tokens", "num_requests")}
    histograms = [Histogram(f"sglang:{name}", name, labels, buckets=_LATENCY_BUCKETS, registry=r)
                  for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")]
    for dp_rank, tp_rank, num_running, num_waiting in ranks:
        values = ("tiny-llama", "unified", dp_rank, tp_rank, "0")
        gauges["num_running_reqs"].labels(*values).set(num_running)
        gauges["num_queue_reqs"].labels(*values).set(num_waiting)
        gauges["num_running_reqs_offline_batch"].labels(*values).set(99)
        gauges["token_usage"].labels(*values).set(0.25)
        gauges["cache_hit_rate"].labels(*values).set(0.2)
        counters["prompt_tokens"].labels(*values).inc(800)
        counters["cached_tokens"].labels(*values).inc(200)
        counters["generation_tokens"].labels(*values).inc(100)
        for histogram in histograms:
            histogram.labels(*values).observe(0.2)
    return generate_latest(r).decode()


def llamacpp_text(processing: int, deferred: int, prompt: int, cached: int, predicted: int, kv_ratio: float | None = None) -> str:
    """llama-server's /metrics as tools/server renders it: HELP and TYPE lines, then one unlabelled sample."""
    counters = [("prompt_tokens_total", prompt), ("prompt_tokens_cached_total", cached), ("prompt_seconds_total", 1.5),
                ("tokens_predicted_total", predicted), ("tokens_predicted_seconds_total", 3.25), ("n_decode_total", 40), ("n_tokens_max", 300)]
    gauges = [("prompt_tokens_seconds", 120.5), ("predicted_tokens_seconds", 30.25), ("requests_processing", processing),
              ("requests_deferred", deferred), ("n_busy_slots_per_decode", 1.5)]
    if kv_ratio is not None:  # older builds
        gauges.append(("kv_cache_usage_ratio", kv_ratio))
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, value in items:
            lines += [f"# HELP llamacpp:{name} {name}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"


def test_vllm_sums_data_parallel_engines_and_averages_kv_use() -> None:
    load = parse_load("vllm", vllm_text({"0": (3, 2, 0.5), "1": (1, 0, 0.25)}), now=7.0)
    assert load == EngineLoad(scraped_at=7.0, num_running=4, num_waiting=2, kv_usage_fraction=0.375, prefix_cache_queries_tokens=2000.0,
                              prefix_cache_hits_tokens=800.0, prompt_tokens_total=2000.0, generation_tokens_total=500.0)
    assert load.num_requests == 6


def test_vllm_older_names_are_read_too() -> None:
    load = parse_load("vllm", vllm_text({"0": (5, 1, 0.75)}, old_names=True), now=0.0)
    assert (load.num_running, load.num_waiting, load.kv_usage_fraction) == (5, 1, 0.75)
    assert (load.prefix_cache_queries_tokens, load.prefix_cache_hits_tokens) == (1000.0, 400.0)


def test_sglang_counts_each_scheduler_once() -> None:
    # two data-parallel schedulers, each over two tensor-parallel ranks that repeat its figures
    text = sglang_text([("0", "0", 3, 1), ("0", "1", 3, 1), ("1", "0", 2, 4), ("1", "1", 2, 4)])
    load = parse_load("sglang", text, now=1.0)
    assert (load.num_running, load.num_waiting, load.kv_usage_fraction) == (5, 5, 0.25)  # offline-batch gauge not mistaken for running
    assert (load.prompt_tokens_total, load.prefix_cache_queries_tokens, load.prefix_cache_hits_tokens) == (1600.0, 1600.0, 400.0)
    assert parse_load("emulated", text, now=1.0) == load


def test_llamacpp_counts_cached_prompt_tokens_as_prompt_and_prefix_hits() -> None:
    load = parse_load("llamacpp", llamacpp_text(processing=2, deferred=3, prompt=900, cached=100, predicted=64), now=2.0)
    assert load == EngineLoad(scraped_at=2.0, num_running=2, num_waiting=3, kv_usage_fraction=None, prefix_cache_queries_tokens=1000.0,
                              prefix_cache_hits_tokens=100.0, prompt_tokens_total=1000.0, generation_tokens_total=64.0)
    assert parse_load("llamacpp", llamacpp_text(1, 0, 10, 0, 5, kv_ratio=0.125), now=2.0).kv_usage_fraction == 0.125


def test_missing_figures_are_zero_or_none_and_comments_and_other_metrics_are_ignored() -> None:
    text = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_running 2 1700000000000\nvllm:num_requests_running_total 9\r\n"
    assert parse_load("vllm", text, now=0.0) == EngineLoad(scraped_at=0.0, num_running=2, num_waiting=0)
    assert parse_load("vllm", 'vllm:num_requests_waiting{model_name="a b}c"} NaN\nvllm:num_requests_running{x="1"} 1', now=0.0).num_requests == 1


def test_a_text_without_the_kinds_load_metrics_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no llamacpp load metrics \(llamacpp:requests_processing, llamacpp:requests_deferred\)"):
        parse_load("llamacpp", vllm_text({"0": (1, 1, 0.5)}), now=0.0)
    with pytest.raises(ValueError, match="no sglang load metrics"):
        parse_load("sglang", "", now=0.0)
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        parse_load("tgi", "", now=0.0)
    with pytest.raises(ValueError, match="vllm:num_requests_running: sample value 'lots' is not a number"):
        parse_load("vllm", "vllm:num_requests_running lots\n", now=0.0)


def test_prefix_hit_fraction_is_the_counters_difference_between_scrapes() -> None:
    first = EngineLoad(0.0, 0, 0, prefix_cache_queries_tokens=1000.0, prefix_cache_hits_tokens=100.0)
    second = EngineLoad(1.0, 0, 0, prefix_cache_queries_tokens=1400.0, prefix_cache_hits_tokens=400.0)
    assert prefix_hit_fraction(first, second) == 0.75
    assert prefix_hit_fraction(None, second) is None
    assert prefix_hit_fraction(second, second) is None  # nothing looked up since
    assert prefix_hit_fraction(second, first) is None  # the engine restarted: counters reset
    assert prefix_hit_fraction(EngineLoad(0.0, 0, 0), second) is None  # an engine without the counters


def test_an_emulated_replicas_metrics_are_read(tmp_path: Path) -> None:
    emulator = start_emulator(tmp_path, "emu")
    with running(emulator):
        idle = parse_load("emulated", urllib.request.urlopen(emulator.url + "/metrics", timeout=10).read().decode(), now=0.0)
        assert (idle.num_running, idle.num_waiting, idle.generation_tokens_total) == (0, 0, 0.0)
        body = json.dumps({"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}).encode()
        request = urllib.request.Request(emulator.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        after = parse_load("emulated", urllib.request.urlopen(emulator.url + "/metrics", timeout=10).read().decode(), now=1.0)
        assert after.generation_tokens_total == 7.0 and after.prompt_tokens_total and after.kv_usage_fraction is not None


def test_a_llama_servers_metrics_are_read(tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    with llama_server(llama_server_bin, tiny_gguf, "--metrics", "--parallel", "2", log_path=tmp_path / "llama.log") as server:
        body = json.dumps({"model": install.TINY_MODEL, "prompt": "The quick brown fox jumps over the lazy dog and runs into the forest", "max_tokens": 8,
                           "ignore_eos": True}).encode()
        for _ in range(2):  # the same prompt twice: the second is found in the slot's prompt cache
            request = urllib.request.Request(server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=60).read()
        load = parse_load("llamacpp", urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode(), now=3.0)
    assert (load.num_running, load.num_waiting, load.generation_tokens_total) == (0, 0, 16.0)
    assert load.kv_usage_fraction is None  # this build exports no KV usage
    assert load.prompt_tokens_total == load.prefix_cache_queries_tokens and load.prompt_tokens_total is not None
    assert load.prefix_cache_hits_tokens and 0 < load.prefix_cache_hits_tokens < load.prompt_tokens_total
