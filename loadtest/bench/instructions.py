"""``polymorph bench instructions``: the gateway's CPU instructions per request, counted by callgrind.

Wall-clock figures on this shared 2-core machine swing by 10-30% between runs; instruction counts
do not, so they are how a change to the request path (classify, route, proxy) is judged against the
code before it. A gateway runs under ``valgrind --tool=callgrind --instr-atstart=no`` (uninstrumented,
so start-up is only a few times slower) in front of four fast stub backends in two pools of two
replicas, so the router ranks pools and picks replicas as it does in production. After a warm-up,
instrumentation is switched on with ``callgrind_control -i on``, a fixed, deterministic request mix
is sent one at a time on one keep-alive connection (short chats sharing a system prompt, so prefix
affinity engages; unique short chats; long prompts that classify as long-context; one in four
streamed), and ``callgrind_control -d`` dumps the count. Each round is one such dump; the figure is
the median over rounds of Ir (instructions executed) divided by requests.

``--baseline-tree DIR`` measures another checkout of this repository (say ``git worktree add DIR
REF``) in the same run, rounds alternating, and the JSON line gives the ratio current/baseline.
The gateway's periodic work (health probes, engine scrapes) is set to once an hour, so a round
counts requests, not the seconds they took. Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest import fast_backend, procs

MODEL = "fast-backend"  # what loadtest.fast_backend serves
API_KEY = "sk-bench-instructions"
_START_TIMEOUT_S = 300.0  # a gateway's start under valgrind, uninstrumented, on a loaded machine
_SYSTEM_PROMPT = "You are a careful assistant for the platform team. Answer in one short paragraph. " * 8
_LONG_PROMPT = "The quarterly report lists every region's figures and their causes in detail. " * 420  # > 4096 tokens


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Round:
    tree: str  # "current" or "baseline"
    num_requests: int
    instructions: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.num_requests


def request_body(index: int) -> tuple[bytes, bool]:
    """Request ``index`` of the mix and whether it streams; the same for every tree and round."""
    kind = index % 4
    stream = index % 4 == 3
    if kind == 0:
        messages = [{"role": "system", "content": _SYSTEM_PROMPT}, {"role": "user", "content": f"Question {index}: what changed?"}]
    elif kind == 1:
        messages = [{"role": "user", "content": f"Write a haiku about request {index}."}]
    elif kind == 2:
        messages = [{"role": "user", "content": _LONG_PROMPT + f" Summarise part {index}."}]
    else:
        messages = [{"role": "system", "content": _SYSTEM_PROMPT}, {"role": "user", "content": f"Stream an answer to {index}."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": stream}
    return json.dumps(body).encode(), stream


def write_config(run_dir: Path, port: int, backend_ports: Sequence[int]) -> Path:
    """Two pools of two replicas each over the stub backends, and a tenant with limits far above the load."""
    tenants = run_dir / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    tenant = {"name": "bench", "api_key_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()], "max_concurrency": 100_000,
              "rate_limits": {"requests_per_min": 10_000_000, "tokens_per_min": 10_000_000_000}}
    (tenants / "bench.yaml").write_text(json.dumps(tenant))  # JSON is YAML
    urls = [f"http://127.0.0.1:{p}" for p in backend_ports]
    pools = [{"name": "chat", "model": MODEL, "shapes": ["short-chat"], "replicas": {"urls": urls[:2]}},
             {"name": "long", "model": MODEL, "shapes": ["long-context"], "replicas": {"urls": urls[2:]}}]
    # Health probes and engine scrapes once an hour: their cost is per wall second, not per request, and
    # at the defaults (2 s, 1 s) they spread a round's count by 2-4% with the machine's load.
    config = {"server": {"host": "127.0.0.1", "port": port, "access_log": False}, "tenants_dir": "tenants",
              "upstream": {"health_interval_s": 3600, "engine_metrics_interval_s": 3600},
              "shapes": [{"name": "long-context", "min_prompt_tokens": 4096}, {"name": "short-chat"}],
              "default_shape": "short-chat", "fleet": {"pools": pools}}
    path = run_dir / f"gateway-{port}.yaml"
    path.write_text(json.dumps(config))
    return path


def send_all(port: int, first: int, num_requests: int) -> None:
    """Send requests ``first`` .. ``first + num_requests - 1`` of the mix, one at a time; raise on any non-200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        for index in range(first, first + num_requests):
            body, _ = request_body(index)
            connection.request("POST", "/v1/chat/completions", body=body,
                               headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            response = connection.getresponse()
            answer = response.read()
            if response.status != 200:
                raise RuntimeError(f"request {index}: HTTP {response.status}: {answer[:300]!r}")
    finally:
        connection.close()


def read_instructions(dump: Path) -> int:
    """The Ir total of one callgrind dump: its ``totals:`` line, the sum of the costs it lists. Not the
    ``summary:`` header: after instrumentation was switched off and on again, valgrind 3.19 writes
    there a negative number as unsigned (18446744073435145848) while ``totals:`` is right."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{dump} has no totals line")


class _Gateway:
    """One gateway under callgrind; ``measure`` counts one round's instructions."""

    def __init__(self, tree: str, source: Path | None, run_dir: Path, backend_ports: Sequence[int], registry: procs.ProcessRegistry) -> None:
        self.tree = tree
        self.port = procs.free_port()
        self.out_dir = run_dir / f"callgrind-{tree}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config = write_config(run_dir, self.port, backend_ports)
        env = dict(os.environ)
        if source is not None:  # the baseline checkout's packages shadow this one's (sys.path comes before the editable finder)
            env["PYTHONPATH"] = str(source)
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out_dir}/callgrind.out",
                sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--no-access-log"]
        self.process = registry.start(f"gateway-{tree}", argv, env=env)
        procs.wait_http(f"http://127.0.0.1:{self.port}/readyz", self.process, _START_TIMEOUT_S)
        self.next_index = 0

    def send(self, num_requests: int) -> None:
        send_all(self.port, self.next_index, num_requests)
        self.next_index += num_requests

    def measure(self, num_requests: int) -> Round:
        before = set(self.out_dir.iterdir())
        _control("-i", "on", self.process.pid)
        self.send(num_requests)
        _control("-d", None, self.process.pid)
        _control("-i", "off", self.process.pid)
        dumps = sorted(set(self.out_dir.iterdir()) - before)
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump under {self.out_dir}")
        return Round(self.tree, num_requests, read_instructions(dumps[-1]))


def _control(option: str, value: str | None, pid: int) -> None:
    argv = ["callgrind_control", option, *([value] if value else []), str(pid)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stdout}{done.stderr}")


@contextmanager
def _backends(registry: procs.ProcessRegistry, count: int) -> Iterator[list[int]]:
    ports = [procs.free_port() for _ in range(count)]
    for port in ports:
        child = registry.start(f"backend-{port}", [*fast_backend.COMMAND, "--port", str(port)])
        procs.wait_http(f"http://127.0.0.1:{port}/health", child, 60.0)
    yield ports


def run(args: argparse.Namespace) -> dict[str, object]:
    trees: list[tuple[str, Path | None]] = [("current", None)]
    if args.baseline_tree:
        baseline = Path(args.baseline_tree).resolve()
        if not (baseline / "gateway" / "cli.py").is_file():
            raise SystemExit(f"bench instructions: {baseline} is not a checkout of this repository (no gateway/cli.py)")
        trees.insert(0, ("baseline", baseline))
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="polymorph-instructions-"))
    rounds: list[Round] = []
    started_at = time.monotonic()
    with procs.ProcessRegistry(run_dir / "logs") as registry, _backends(registry, 4) as ports:
        gateways = [_Gateway(tree, source, run_dir, ports, registry) for tree, source in trees]
        for gateway in gateways:
            gateway.send(args.warmup)  # imports, caches and the classifier's first calls happen here, uncounted
        for index in range(args.rounds):
            for gateway in gateways:
                done = gateway.measure(args.requests)
                rounds.append(done)
                _say(f"round {index + 1}/{args.rounds} {done.tree}: {done.per_request:,.0f} instructions/request")
    tree_to_counts = {tree: [r.per_request for r in rounds if r.tree == tree] for tree, _ in trees}
    per_tree = {tree: statistics.median(counts) for tree, counts in tree_to_counts.items()}
    result: dict[str, object] = {
        "bench": "instructions", "requests_per_round": args.requests, "rounds": args.rounds,
        "instructions_per_request": {tree: round(value) for tree, value in per_tree.items()},
        # (max - min) / median over rounds: how far apart the rounds of one tree were
        "spread": {tree: round((max(counts) - min(counts)) / per_tree[tree], 4) for tree, counts in tree_to_counts.items()},
        "duration_s": round(time.monotonic() - started_at, 1),
    }
    if "baseline" in per_tree:
        result["ratio_current_to_baseline"] = round(per_tree["current"] / per_tree["baseline"], 4)
    return result


def main_bench(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench instructions: valgrind is not installed (Debian: apt-get install valgrind)")
    result = run(args)
    per_tree = result["instructions_per_request"]
    assert isinstance(per_tree, dict)
    for tree, value in per_tree.items():
        print(f"{tree:<10} {value:>12,} instructions/request")
    if "ratio_current_to_baseline" in result:
        print(f"current / baseline: {result['ratio_current_to_baseline']}")
    print(json.dumps(result))
    return 0
