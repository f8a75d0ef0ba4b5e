"""Start each peer gateway in front of one OpenAI-compatible backend and time its start-up.

Start-up time runs from spawning the process to its first correct chat answer, so it covers the
interpreter, imports, configuration and worker registration, which is what an operator waits for.
Each peer runs in its quiet production mode: per-request logging off where the peer has a switch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench import nginx_conf, payloads
from loadtest.bench.processes import Pinning, pinned
from loadtest.bench.stack import Target, chat_url, probe_chat
from loadtest.demo_credentials import DEMO_API_KEY
from loadtest.procs import ProcessRegistry, free_port, wait_for_port

RAW_PEERS = ("direct", "nginx", "sglang-router", "litellm", "polymorph", "polymorph-w2")
_STARTUP_TIMEOUT_S = 180.0
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class StartedPeer:
    target: Target
    startup_s: float | None  # None for direct (nothing starts)


def start_peer(
    name: str, registry: ProcessRegistry, run_dir: Path, upstream_port: int, nginx: str, pinning: Pinning,
    name_to_python: Mapping[str, Path],
) -> StartedPeer:
    """Start raw peer ``name`` (one of RAW_PEERS) in front of 127.0.0.1:``upstream_port``."""
    if name == "direct":
        url = chat_url(upstream_port)
        probe_chat(url, False, _STARTUP_TIMEOUT_S)
        return StartedPeer(Target(name, url, url, None), None)
    port = free_port()
    argv, env = peer_argv(name, upstream_port, port, run_dir, nginx, name_to_python)
    started_at = time.monotonic()
    child = registry.start(name, pinned(argv, pinning.proxy_cpus), env=env)
    wait_for_port(port, child, _STARTUP_TIMEOUT_S)
    url = chat_url(port)
    probe_chat(url, False, _STARTUP_TIMEOUT_S, poll_s=_POLL_S)
    startup_s = time.monotonic() - started_at
    return StartedPeer(Target(name, url, url, child.pid), startup_s)


def peer_argv(
    name: str, upstream_port: int, port: int, run_dir: Path, nginx: str, name_to_python: Mapping[str, Path],
) -> tuple[list[str], dict[str, str] | None]:
    upstream = f"http://127.0.0.1:{upstream_port}"
    if name == "nginx":
        conf_dir = run_dir / "nginx-peer"
        conf = nginx_conf.write_config(conf_dir, nginx_conf.proxy_config(conf_dir, port, upstream_port))
        return [nginx, "-c", str(conf), "-p", str(conf_dir), "-e", str(conf_dir / "error.log")], None
    if name == "sglang-router":
        return sglang_router_argv(name_to_python[name], [upstream], port, "cache_aware"), None
    if name == "litellm":
        config = write_litellm_config(run_dir / "litellm.yaml", f"{upstream}/v1")
        return litellm_argv(name_to_python[name], config, port), litellm_env()
    if name in ("polymorph", "polymorph-w2"):
        workers = ["--workers", "2"] if name == "polymorph-w2" else []
        serve = ["serve", "--upstream", upstream, "--port", str(port), *workers]
        return [sys.executable, "-m", "gateway.cli", *serve], None
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(RAW_PEERS)}")


def sglang_router_argv(python: Path, worker_urls: Sequence[str], port: int, policy: str) -> list[str]:
    return [
        str(python), "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
        # Its metrics listener defaults to a fixed port (29000): two routers at once would collide.
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]


def litellm_argv(python: Path, config: Path, port: int) -> list[str]:
    return [str(python.parent / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]


def litellm_env() -> dict[str, str]:
    # The local price list instead of a download; no telemetry; the bench key as the master key.
    return {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}


def write_litellm_config(path: Path, api_base: str, model: str = payloads.MODEL_ID) -> Path:
    """A LiteLLM proxy config with one deployment of ``model`` at ``api_base`` (JSON is valid YAML)."""
    import orjson

    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {"model": f"openai/{model}", "api_base": api_base, "api_key": "dummy"},
            }
        ],
        "general_settings": {"master_key": DEMO_API_KEY},
        "litellm_settings": {"telemetry": False},
    }
    path.write_bytes(orjson.dumps(config))
    return path
