"""Start the backend and every proxy variant in front of it; each variant serves JSON and SSE.

The nginx backend answers JSON on one port and SSE on another, so each proxy variant runs one
instance per backend port (the idle one costs nothing while the other is measured).
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench import nginx_conf, payloads
from loadtest.bench.processes import Pinning, pinned
from loadtest.demo_credentials import DEMO_API_KEY
from loadtest.procs import ProcessRegistry, free_port, wait_for_port

VARIANTS = ("direct", "passthrough", "nginx", "gateway")
_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Target:
    """One variant's two endpoints and the pid whose memory is watched (None: nothing to watch)."""

    name: str
    json_url: str
    stream_url: str
    pid: int | None


@dataclass(frozen=True, slots=True)
class Backend:
    json_port: int
    stream_port: int


def chat_url(port: int) -> str:
    return f"http://127.0.0.1:{port}{payloads.CHAT_PATH}"


def start_backend(registry: ProcessRegistry, run_dir: Path, nginx: str, pinning: Pinning) -> Backend:
    backend = Backend(json_port=free_port(), stream_port=free_port())
    conf_dir = run_dir / "backend"
    conf = nginx_conf.write_config(conf_dir, nginx_conf.backend_config(conf_dir, backend.json_port, backend.stream_port))
    child = registry.start("backend-nginx", pinned(_nginx_argv(nginx, conf, conf_dir), pinning.backend_cpus))
    for port in (backend.json_port, backend.stream_port):
        wait_for_port(port, child, _STARTUP_TIMEOUT_S)
    return backend


def start_target(
    name: str, registry: ProcessRegistry, run_dir: Path, backend: Backend, nginx: str, pinning: Pinning,
    gateway_args: Sequence[str],
) -> Target:
    """Start variant ``name`` (one of VARIANTS) and check it answers a chat request correctly."""
    if name == "direct":
        target = Target(name, chat_url(backend.json_port), chat_url(backend.stream_port), None)
    elif name == "nginx":
        target = _start_nginx_proxy(registry, run_dir, backend, nginx, pinning)
    else:
        pids = []
        ports = []
        for mode, upstream_port in (("json", backend.json_port), ("stream", backend.stream_port)):
            port = free_port()
            argv = _python_proxy_argv(name, f"http://127.0.0.1:{upstream_port}", port, gateway_args)
            child = registry.start(f"{name}-{mode}", pinned(argv, pinning.proxy_cpus))
            wait_for_port(port, child, _STARTUP_TIMEOUT_S)
            pids.append(child.pid)
            ports.append(port)
        target = Target(name, chat_url(ports[0]), chat_url(ports[1]), pids[0])
    for url, stream in ((target.json_url, False), (target.stream_url, True)):
        probe_chat(url, stream, _STARTUP_TIMEOUT_S)
    return target


def _start_nginx_proxy(
    registry: ProcessRegistry, run_dir: Path, backend: Backend, nginx: str, pinning: Pinning
) -> Target:
    ports = []
    children = []
    for mode, upstream_port in (("json", backend.json_port), ("stream", backend.stream_port)):
        port = free_port()
        conf_dir = run_dir / f"nginx-proxy-{mode}"
        conf = nginx_conf.write_config(conf_dir, nginx_conf.proxy_config(conf_dir, port, upstream_port))
        child = registry.start(f"nginx-proxy-{mode}", pinned(_nginx_argv(nginx, conf, conf_dir), pinning.proxy_cpus))
        wait_for_port(port, child, _STARTUP_TIMEOUT_S)
        ports.append(port)
        children.append(child)
    return Target("nginx", chat_url(ports[0]), chat_url(ports[1]), children[0].pid)


def _nginx_argv(nginx: str, conf: Path, conf_dir: Path) -> list[str]:
    # -e: nginx's start-up log goes to our directory, not /var/log/nginx (unwritable without root).
    return [nginx, "-c", str(conf), "-p", str(conf_dir), "-e", str(conf_dir / "error.log")]


def _python_proxy_argv(name: str, upstream_url: str, port: int, gateway_args: Sequence[str]) -> list[str]:
    if name == "passthrough":
        return [sys.executable, "-m", "loadtest.bench.passthrough", "--upstream", upstream_url, "--port", str(port)]
    if name == "gateway":
        return [
            sys.executable, "-m", "gateway.cli", "serve", "--upstream", upstream_url, "--port", str(port),
            *gateway_args,
        ]
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def describe_answer(url: str, stream: bool) -> str:
    """One chat request's status and the start of its body: says what a run's errors were."""
    request = _chat_request(url, stream)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return f"HTTP {response.status}: {response.read()[:200]!r}"
    except urllib.error.HTTPError as problem:
        answer = f"HTTP {problem.code}: {problem.read()[:300]!r}"
        problem.close()
        return answer
    except (urllib.error.URLError, OSError) as problem:
        return str(problem)


def _chat_request(url: str, stream: bool) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=payloads.chat_request_body(stream),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {DEMO_API_KEY}"},
    )


def probe_chat(url: str, stream: bool, timeout_s: float, poll_s: float = 0.5) -> None:
    """POST one chat request every ``poll_s`` until it succeeds with the expected body kind, or raise."""
    request = _chat_request(url, stream)
    deadline_at = time.monotonic() + timeout_s
    last_problem = ""
    while time.monotonic() < deadline_at:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read()
            expected = b"data: [DONE]" if stream else b'"chat.completion"'
            if expected in body:
                return
            last_problem = f"unexpected body {body[:200]!r}"
        except urllib.error.HTTPError as problem:
            last_problem = f"HTTP {problem.code}: {problem.read()[:300]!r}"
            problem.close()
        except (urllib.error.URLError, OSError) as problem:
            last_problem = str(problem)
        time.sleep(poll_s)
    raise RuntimeError(f"{url} never answered a {'streaming ' if stream else ''}chat request: {last_problem}")
