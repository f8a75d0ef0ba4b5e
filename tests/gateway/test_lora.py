"""LoRA adapters: a pool declares the adapters its engine loads; a request naming one goes only to the pools
holding it and reaches the engine under that name; /v1/models lists adapters with their base model; tenants
may be allowed adapters by name; a bad adapter declaration is a config error with its line."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from gateway.config import load_config
from kernels.yamlsrc import ConfigError
from loadtest.demo_credentials import DEMO_API_KEY
from tests.conftest import REPO
from tests.support.procs import start_emulator, start_gateway, write_tenant

KEY, CHAT_ONLY_KEY = "sk-test-lora", "sk-test-lora-chat-only"
BASE = "llama-3.1-8b"
ADAPTERS = {"sql-lora": "/adapters/sql", "chat-lora": "/adapters/chat"}


def _pool(name: str, **fields: object) -> dict[str, object]:
    return {"name": name, "model": BASE, "gpu": "H100-SXM", "replicas": {"emulated": 1}, **fields}


def _config(tmp_path: Path, pools: list[dict[str, object]], aliases: object = None) -> Path:
    (tmp_path / "tenants").mkdir(exist_ok=True)
    write_tenant(tmp_path / "tenants", "apps", KEY)
    write_tenant(tmp_path / "tenants", "chat-only", CHAT_ONLY_KEY, adapters=["chat-lora"])
    config: dict[str, object] = {"tenants_dir": "tenants", "fleet": {"pools": pools, "emulator_speed": 20.0}}
    if aliases is not None:
        config["aliases"] = aliases
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))  # one key a line: errors name a line of their own
    return path


def test_an_adapter_reaches_only_the_pools_holding_it_and_is_listed_with_its_base(tmp_path: Path) -> None:
    config = _config(tmp_path, [_pool("plain"), _pool("tuned", adapters=ADAPTERS)])
    gateway = start_gateway(tmp_path, ["--config", str(config)])
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        chat_only = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=CHAT_ONLY_KEY, max_retries=0)
        adapted = [client.chat.completions.with_raw_response.create(model="sql-lora", messages=[{"role": "user", "content": "SELECT"}],
                                                                    max_tokens=4) for _ in range(6)]
        based = [client.completions.with_raw_response.create(model=BASE, prompt="Hi", max_tokens=4) for _ in range(6)]
        listed = {m.id: m.model_dump() for m in client.models.list()}
        listed_chat_only = {m.id for m in chat_only.models.list()}
        allowed = chat_only.completions.create(model="chat-lora", prompt="Hi", max_tokens=4)
        with pytest.raises(openai.PermissionDeniedError) as denied:
            chat_only.completions.create(model="sql-lora", prompt="Hi", max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="poetry-lora", prompt="Hi", max_tokens=4)
    finally:
        gateway.stop()
    assert {r.headers["x-polymorph-pool"] for r in adapted} == {"tuned"}
    assert {r.parse().model for r in adapted} == {"sql-lora"}  # the engine was asked for the adapter, by its name
    assert {r.headers["x-polymorph-pool"] for r in based} <= {"plain", "tuned"} and {r.parse().model for r in based} == {BASE}
    assert listed["sql-lora"]["parent"] == BASE and listed["chat-lora"]["parent"] == BASE
    assert "root" not in listed["sql-lora"]  # the adapter's path on the engine host is not the tenant's business
    assert set(listed) == {BASE, "sql-lora", "chat-lora"}
    assert listed_chat_only == {BASE, "chat-lora"} and allowed.model == "chat-lora"
    assert denied.value.status_code == 403 and denied.value.code == "model_not_allowed"


def test_an_emulated_replica_answers_its_adapters_by_name_and_404s_others(tmp_path: Path) -> None:
    replica = start_emulator(tmp_path, "emulator", extra=["--served-model-name", BASE, "--adapter", "chat-lora=/adapters/chat"])
    try:
        with urllib.request.urlopen(replica.url + "/v1/models", timeout=5) as resp:
            models = json.load(resp)["data"]
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="chat-lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    finally:
        replica.stop()
    assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [(BASE, None, BASE), ("chat-lora", BASE, "/adapters/chat")]
    assert answer.model == "chat-lora"


@pytest.mark.parametrize(("pools", "aliases", "field", "key", "reason"), [
    ([_pool("a", adapters={BASE: "/x"})], None, "fleet.pools[0].adapters", BASE, "the pool's own model"),
    ([_pool("a"), _pool("b", model="qwen3-8b", adapters={BASE: "/x"})], None, "fleet.pools[1].adapters", BASE, "a model a pool serves"),
    ([_pool("a", adapters={"sql-lora": "/x"}), _pool("b", adapters={"sql-lora": "/y"})], None, "fleet.pools[1].adapters", "sql-lora",
     "same base model and path"),
    ([_pool("a", engine={"kind": "llamacpp"}, replicas={"launch": 1}, gpu="cpu", adapters={"sql-lora": "/x"})], None,
     "fleet.pools[0].adapters", "adapters", "llama-server selects LoRA adapters by id"),
    ([_pool("a", adapters={"sql-lora": "/x"})], {"sql-lora": BASE}, "aliases.sql-lora", "sql-lora", "is a LoRA adapter"),
])
def test_a_bad_adapter_declaration_is_a_config_error_with_its_line(tmp_path: Path, pools: list[dict[str, object]], aliases: object,
                                                                  field: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, pools, aliases))
    assert info.value.field.startswith(field) and reason in info.value.reason and info.value.file.endswith("config.yaml")
    lines = Path(info.value.file).read_text().splitlines()
    assert info.value.line is not None and lines[info.value.line - 1].lstrip().startswith(key + ":")  # the line that declares it


def test_the_lora_example_routes_an_alias_and_an_adapter_to_their_pools(tmp_path: Path) -> None:
    """examples/lora.yaml, as `make run CONFIG=examples/lora.yaml` serves it (the demo tenant's key)."""
    gateway = start_gateway(tmp_path, ["--config", str(REPO / "examples" / "lora.yaml"), "--no-access-log"])
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=DEMO_API_KEY, max_retries=0)
        aliased = client.completions.with_raw_response.create(model="assistant", prompt="Hi", max_tokens=2)
        adapted = client.completions.with_raw_response.create(model="chat-lora", prompt="Hi", max_tokens=2)
    finally:
        gateway.stop()
    assert aliased.headers["x-polymorph-pool"] in {"plain", "tuned"} and aliased.parse().model == BASE
    assert adapted.headers["x-polymorph-pool"] == "tuned" and adapted.parse().model == "chat-lora"
