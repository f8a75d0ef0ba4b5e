"""Model aliases: a public name resolved to a served model before anything else sees the request,
listed (or hidden) in /v1/models, both names in the access log; a bad alias is a config error."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from gateway.config import load_config
from kernels.yamlsrc import ConfigError
from tests.support.procs import start_gateway, write_tenant

KEY = "sk-test-alias"


def _config(tmp_path: Path, aliases: object) -> Path:
    (tmp_path / "tenants").mkdir(exist_ok=True)
    write_tenant(tmp_path / "tenants", "apps", KEY, models=["gpt-4o-mini", "llama-3.1-8b", "internal"])
    config = {
        "server": {"access_log": True},
        "tenants_dir": "tenants",
        "aliases": aliases,
        "fleet": {"pools": [{"name": "chat", "model": "llama-3.1-8b", "gpu": "H100-SXM", "replicas": {"emulated": 1}}],
                  "emulator_speed": 20.0},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def test_an_alias_reaches_its_served_model_and_is_listed_unless_hidden(tmp_path: Path) -> None:
    aliases = {"gpt-4o-mini": "llama-3.1-8b", "internal": {"model": "llama-3.1-8b", "listed": False}}
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, aliases))])
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        listed = {m.id for m in client.models.list()}
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        hidden = client.completions.create(model="internal", prompt="Hi", max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        time.sleep(0.5)  # the access log flushes every 0.25 s
    finally:
        gateway.stop()
    assert listed == {"llama-3.1-8b", "gpt-4o-mini"}  # "internal" answers but is not listed
    assert raw.headers["x-polymorph-pool"] == "chat" and raw.parse().model == "llama-3.1-8b"
    assert hidden.choices[0].text
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith('{"ts"')]
    assert {(line["model"], line["alias"]) for line in lines if line["status"] == 200} == {("llama-3.1-8b", "gpt-4o-mini"), ("llama-3.1-8b", "internal")}


@pytest.mark.parametrize(("aliases", "reason"), [
    ({"gpt-4o": "mistral-7b"}, "no pool serves 'mistral-7b'"),
    ({"llama-3.1-8b": "llama-3.1-8b"}, "not itself or another alias"),
    ({"a": "b", "b": "llama-3.1-8b"}, "not itself or another alias"),
    ({"gpt-4o": {"listed": False}}, "names the served model"),
])
def test_a_bad_alias_is_rejected_with_its_line(tmp_path: Path, aliases: object, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, aliases))
    assert info.value.field.startswith("aliases.") and reason in info.value.reason and info.value.line > 0
