"""The shipped real-engine example, served as a user would: ``polymorph serve --config
examples/cpu-llamacpp.yaml`` launches two pools of real ``llama-server`` replicas of the tiny model on
CPU slots and answers the README's openai SDK examples, streamed and not, with the routing headers;
a stream whose client did not ask for usage still counts its tokens."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import openai
import pytest

from loadtest.demo_credentials import DEMO_ADMIN_TOKEN, DEMO_API_KEY
from tests.conftest import REPO
from tests.support.engines import llama_server
from tests.support.procs import start_gateway, write_tenant


def _tokens_total(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^polymorph_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


@pytest.mark.slow
def test_the_llamacpp_example_serves_the_sdk_streamed_and_not_through_real_replicas(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    gateway = start_gateway(tmp_path, ["--config", str(REPO / "examples" / "cpu-llamacpp.yaml"), "--no-access-log"], timeout_s=120)
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=DEMO_API_KEY, max_retries=0, timeout=60)
        models = [m.id for m in client.models.list()]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Summarise the plot of Hamlet in two sentences."}], max_tokens=16)
        reply = raw.parse()
        long_prompt = "Read this report carefully. " * 200  # about 1,200 tokens: the long-context shape
        long = client.completions.with_raw_response.create(model="tiny-llama", prompt=long_prompt, max_tokens=8)
        before = _tokens_total(gateway.url)
        with client.chat.completions.with_streaming_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": "Write a haiku about GPUs."}], max_tokens=12, stream=True) as stream:
            stream_pool = stream.headers["x-polymorph-pool"]
            chunks = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: {")]
        after = _tokens_total(gateway.url)
        request = urllib.request.Request(gateway.url + "/admin/state", headers={"Authorization": f"Bearer {DEMO_ADMIN_TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            state = json.loads(resp.read())
    finally:
        gateway.stop()
    assert models == ["tiny-llama"]
    assert raw.headers["x-polymorph-pool"] == "chat-cpu" and raw.headers["x-polymorph-replica"] == "chat-cpu-0"
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens == 16
    assert long.headers["x-polymorph-pool"] == "long-cpu" and long.parse().usage.prompt_tokens > 1000  # type: ignore[union-attr]
    # the client did not ask for usage: it gets none, yet the gateway counted the stream's tokens
    assert stream_pool == "chat-cpu" and chunks and all(not c.get("usage") for c in chunks)
    assert "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert after - before >= 12
    replicas = {r["name"]: r for p in state["pools"] for r in p["replicas"]}
    assert {r["engine_kind"] for r in replicas.values()} == {"llamacpp"}
    chat = replicas["chat-cpu-0"]["process"]
    assert chat["argv"][chat["argv"].index("--parallel") + 1] == "4" and chat["argv"][chat["argv"].index("-t") + 1] == "1"
    assert chat["devices"] == ["0"] and replicas["long-cpu-0"]["process"]["devices"] == ["1"]


def test_embeddings_reach_a_real_llama_server_started_with_embeddings(tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    """llama-server serves /v1/embeddings when started with --embeddings: the SDK's embeddings go through the
    gateway to it and come back as one vector a text, of the tiny model's width, with its usage."""
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", "sk-embed", rate_limits={"requests_per_min": 100000})
    with llama_server(llama_server_bin, tiny_gguf, "--embeddings", "--pooling", "mean", log_path=tmp_path / "llama.log") as server:
        config = {"server": {"host": "127.0.0.1"}, "tenants_dir": "tenants",
                  "fleet": {"pools": [{"name": "embed", "model": "tiny-llama", "engine": {"kind": "llamacpp"}, "replicas": {"urls": [server.url]}}]}}
        (tmp_path / "config.yaml").write_text(json.dumps(config))
        gateway = start_gateway(tmp_path, ["--config", str(tmp_path / "config.yaml")])
        try:
            with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-embed", max_retries=0, timeout=60) as client:
                raw = client.embeddings.with_raw_response.create(model="tiny-llama", input=["The cat sat on the mat.", "GPUs are fast."])
        finally:
            gateway.stop()
    answer = raw.parse()
    assert raw.headers["x-polymorph-pool"] == "embed" and raw.headers["x-polymorph-replica"] == "embed-0"
    assert [len(item.embedding) for item in answer.data] == [384, 384]  # the tiny model's width
    assert answer.data[0].embedding != answer.data[1].embedding and answer.usage.prompt_tokens > 0
