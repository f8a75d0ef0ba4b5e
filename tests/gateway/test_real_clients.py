"""Tools people already use work unchanged against Polymorph: curl, and LiteLLM's SDK as a client.

The openai SDK (sync, async, streaming, with_raw_response) is covered in test_gateway_e2e.py.
LiteLLM is never a project dependency: its SDK runs in a subprocess from the venv that `polymorph bench
peers` uses (the same pin and folder under the project's cache), installed on first use, with the
peers bench's environment (its local price list, no telemetry). It stays in this network namespace:
it must reach the test's gateway on loopback, which a fresh namespace's own loopback cannot.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.bench.peers_stack import litellm_env
from tests.support.procs import Proc, start_emulator, start_gateway

MODEL = "llama-3.1-8b"
KEY = "sk-polymorph-demo"  # the demo tenant of `polymorph serve --upstream`


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("real-clients")
    emulator = start_emulator(tmp, "emu", extra=["--served-model-name", MODEL])
    try:
        proc = start_gateway(tmp, ["--upstream", emulator.url])
    except Exception:
        emulator.stop()
        raise
    yield proc
    proc.stop()
    emulator.stop()


def _curl(curl: str, gateway: Proc, *extra: str, body: dict[str, object] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [curl, "-sS", "--max-time", "20", "-H", f"Authorization: Bearer {KEY}", *extra]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body), gateway.url + "/v1/chat/completions"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def _chat(**fields: object) -> dict[str, object]:
    messages = [{"role": "user", "content": "Say hello in five words."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 6, "ignore_eos": True, **fields}


def test_curl_chat_completion_with_headers(curl: str, gateway: Proc, tmp_path: Path) -> None:
    done = _curl(curl, gateway, "--dump-header", str(tmp_path / "head"), body=_chat())

    head = (tmp_path / "head").read_text()
    assert done.returncode == 0, done.stderr
    assert head.startswith("HTTP/1.1 200")
    assert "x-polymorph-pool:" in head.lower()
    answer = json.loads(done.stdout)
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == 6


def test_curl_streams_sse_to_done_with_usage(curl: str, gateway: Proc) -> None:
    done = _curl(curl, gateway, "-N", body=_chat(stream=True, stream_options={"include_usage": True}))

    events = [line[len("data: "):] for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert done.returncode == 0, done.stderr
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_curl_lists_models_and_sees_a_401_without_a_key(curl: str, gateway: Proc) -> None:
    listed = _curl(curl, gateway, gateway.url + "/v1/models")
    refused = subprocess.run(
        [curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", gateway.url + "/v1/models"],
        capture_output=True, text=True, timeout=30, check=False,
    )

    assert [model["id"] for model in json.loads(listed.stdout)["data"]] == [MODEL]
    assert refused.stdout == "401"


_LITELLM_SCRIPT = """
import json, sys
import litellm
base, key, model = sys.argv[1:4]
messages = [{"role": "user", "content": "Say hello in five words."}]
common = dict(model="openai/" + model, api_base=base, api_key=key, messages=messages, max_tokens=6,
              extra_body={"ignore_eos": True})
answer = litellm.completion(**common)
pieces = [chunk.choices[0].delta.content or "" for chunk in litellm.completion(**common, stream=True)]
print(json.dumps({"content": answer.choices[0].message.content, "usage": answer.usage.completion_tokens,
                  "model": answer.model, "streamed": "".join(pieces)}))
"""


@pytest.mark.slow
def test_litellm_sdk_as_a_client(litellm_python: Path, gateway: Proc) -> None:
    env = litellm_env()
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(litellm_python), "-c", _LITELLM_SCRIPT, gateway.url + "/v1", KEY, MODEL],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(sys.prefix), check=False,
    )

    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["usage"] == 6
    assert result["content"]
    assert result["streamed"]
