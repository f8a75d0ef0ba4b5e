"""The emulated replica over real HTTP: OpenAI SDK, sglang native routes, metrics, prefix cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from classifiers.tokens import count_chat_tokens, estimate_tokens
from tests.fleet.emulator_helpers import get_json, parse_metrics, post_json, request
from tests.support.procs import start_emulator


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = start_emulator(tmp_path_factory.mktemp("emulator"), "api", speed=1.0,
                          extra=["--config", '{"max_running_requests": 64}'])
    try:
        yield proc.url
    finally:
        proc.stop()


@pytest.fixture
def client(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers in Europe."}]


def test_chat_non_stream_usage_is_exact(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7, extra_body={"ignore_eos": True})
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 7
    assert reply.usage.prompt_tokens == count_chat_tokens(MESSAGES)
    assert reply.choices[0].finish_reason == "length"
    assert len(reply.choices[0].message.content.split()) == 7
    assert reply.model == "Llama-3.1-8B"


def test_chat_stream_with_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.total_tokens == 12 + count_chat_tokens(MESSAGES)


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens == estimate_tokens(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=5, stream=True, extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == reply.choices[0].text  # deterministic in the prompt


def test_max_tokens_caps_a_natural_length_and_no_max_tokens_is_deterministic(client: openai.OpenAI) -> None:
    capped = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert capped.usage is not None and capped.usage.completion_tokens <= 3
    first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi"}])
    second = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi"}])
    assert first.usage is not None and second.usage is not None
    assert first.usage.completion_tokens == second.usage.completion_tokens >= 1
    assert first.choices[0].finish_reason == "stop"


def test_stop_string_ends_the_output(client: openai.OpenAI) -> None:
    full = client.completions.create(model="m", prompt="abc", max_tokens=40, extra_body={"ignore_eos": True})
    words = full.choices[0].text.split()
    stop = " " + words[5]
    cut = client.completions.create(model="m", prompt="abc", max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and full.choices[0].text.startswith(cut.choices[0].text)
    assert cut.usage is not None and cut.usage.completion_tokens <= 6


def test_bad_request_gets_the_openai_error_envelope(base: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[], max_tokens=3)
    assert caught.value.status_code == 400
    status, body = post_json(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["type"] == "invalid_request_error"
    status, _ = request(base, "POST", "/v1/completions", None)
    assert status == 400


def test_models_and_sglang_info_routes(base: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["Llama-3.1-8B"]
    for path in ("/server_info", "/get_server_info"):
        info = get_json(base, path)
        assert info["max_running_requests"] == 64 and info["tp_size"] == 1 and info["max_total_num_tokens"] > 100_000
    for path in ("/model_info", "/get_model_info"):
        assert get_json(base, path)["is_generation"] is True
    assert request(base, "GET", "/health")[0] == 200


def test_generate_native_route(base: str) -> None:
    status, body = post_json(base, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    assert status == 200
    assert body["meta_info"]["completion_tokens"] == 6 and body["meta_info"]["finish_reason"]["type"] == "length"
    status, raw = request(base, "POST", "/generate", {"text": "hello", "stream": True,
                                                      "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert '"completion_tokens":6' in events[-2]


def test_prefix_cache_hits_show_in_usage_and_metrics(base: str, client: openai.OpenAI) -> None:
    system = "You are a careful assistant. " * 400  # ~11 kB: several 512-token prefix blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body={"ignore_eos": True})
    messages[1]["content"] = "Second question?"
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens >= 1024
    status, raw = request(base, "GET", "/metrics")
    samples = parse_metrics(raw.decode())
    assert status == 200 and samples["sglang:cache_hit_rate"] > 0.0
    assert samples["sglang:cached_tokens_total"] >= 1024


def test_metrics_gauges_and_counters_parse(base: str, client: openai.OpenAI) -> None:
    before = parse_metrics(request(base, "GET", "/metrics")[1].decode())
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True})
    after = parse_metrics(request(base, "GET", "/metrics")[1].decode())
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput", "num_used_tokens"):
        assert f"sglang:{gauge}" in after
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 4
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == count_chat_tokens(MESSAGES)
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    assert after["sglang:time_to_first_token_seconds_count"] >= 1
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:gen_throughput"] > 0


def test_tokens_arrive_at_the_modelled_pace(base: str, client: openai.OpenAI) -> None:
    started = time.monotonic()
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100, extra_body={"ignore_eos": True})
    elapsed_s = time.monotonic() - started
    # Llama-3.1-8B on one H100 decodes one sequence in ~6-7 ms per token in the roofline.
    assert 0.4 < elapsed_s < 1.5



def test_emulate_refuses_what_sglang_would_not_start_and_an_address_it_cannot_take() -> None:
    """Before: tp 3 for 32 heads and MTP on Llama served; a duplicate adapter name kept its last path; an
    unusable --host was a traceback."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "gateway.cli", "emulate", "--model", "llama-3.1-8b", "--gpu", "H100", "--port", "0"]
    for extra, says in ((["--config", '{"tp": 3}'], "tp 3 does not divide the 32 attention heads"),
                        (["--config", '{"speculative_algorithm": "MTP"}'], "needs a checkpoint with MTP heads"),
                        (["--adapter", "a=/tmp/x", "--adapter", "a=/tmp/y"], "--adapter 'a' is given twice"),
                        (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1:0")):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, check=False)
        out = done.stdout + done.stderr
        assert done.returncode == 2 and says in out and "Traceback" not in out, out
