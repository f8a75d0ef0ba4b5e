"""``polymorph bench priority``: do tiers reach the engine? Interactive TTFT under a batch flood, with and without priorities.

One real vLLM replica of the tiny model (CPU build) runs ``--scheduling-policy priority`` with a small
batch (``--max-num-seqs``), so a flood of batch requests queues inside the engine. A gateway fronts it
with two pools on the same replica: ``tiny-llama`` schedules by priority (the gateway sends each
request's tier priority: interactive 0, batch 2), ``tiny-llama-flat`` does not (no ``priority`` is
sent, so every request has vLLM's default and the queue is first come, first served). Three phases
on that replica, run side by side in ``--rounds`` rounds (each with a share of the interactive
requests; the engine idle before each), so the host's other load weighs on each phase alike:

- ``alone``: interactive requests only;
- ``flood+priority``: the same interactive requests while a closed loop of batch requests floods the engine;
- ``flood, no priority``: the same, through the pool without priorities.

Interactive requests go out on a fixed schedule (open loop) and each one's TTFT is measured from its
send. Prints a table (with how many interactive requests waited in the gateway's queue, and how long
on average), which flooded interactive TTFTs had a batch request's prefill in their window, any
failure, then one JSON line of the TTFT p99 ratios. Loopback only. With the defaults the phases take
about two minutes; the engine's start takes 40 s on an idle machine (2-3 minutes under load).

The priority pool admits the engine's batch size (``max_in_flight_per_replica``) and keeps room from
batch requests (``router.urgent_reserve``, ``--urgent-reserve``): they wait in the gateway's queue, so
an interactive request starts at the engine's next step instead of after a batch request finishes
(vLLM's priority scheduler orders its waiting queue but does not preempt a full batch). The room kept
is the share, or, when more, the interactive requests the pool had in flight at once lately plus one
(fleet.urgent_demand): an interactive request runs for several engine steps and the next one arrives
meanwhile, so one reserved slot of four left the second to wait for a batch answer to end.
README.md ("Real engines") records the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from fleet.engines.metrics import parse_load
from loadtest import procs
from loadtest.client import PreparedRequest, prepare, send
from loadtest.metrics import percentiles
from loadtest.record import RequestRecord
from loadtest.spec import RequestSpec

MODEL = "tiny-llama"
FLAT_MODEL = "tiny-llama-flat"  # the same replica, reached through a pool that sends no priorities
API_KEY = "sk-bench-priority"
PHASES = ("alone", "flood+priority", "flood, no priority")
_VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
_INTERACTIVE_TEXT = "Reply with a short greeting for the team."
_BATCH_TEXT = "Summarise the following report in detail. " + " ".join(f"Section {i} lists the quarterly figures and their causes." for i in range(24))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _child(argv: Sequence[str], health_url: str, log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run ``argv`` (its own process group) until the block ends; healthy when the block starts."""
    process = procs.start_healthy(argv, health_url, log, timeout_s, env={**os.environ, **(env or {})}, new_session=True)
    try:
        yield
    finally:
        procs.stop(process, grace_s=15.0, group=True)


def _vllm_argv(python: Path, model_dir: Path, port: int, max_num_seqs: int) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, FLAT_MODEL, "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
            "--host", "127.0.0.1", "--port", str(port), "--scheduling-policy", "priority", "--max-num-seqs", str(max_num_seqs)]


def _write_gateway_config(run_dir: Path, vllm_url: str, max_num_seqs: int, urgent_reserve: float, urgent_window_s: float) -> Path:
    tenants = run_dir / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    tenant = {"name": "bench", "api_key_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()], "tiers": ["interactive", "batch"],
              "default_tier": "interactive", "max_concurrency": 10000, "rate_limits": {"requests_per_min": 1000000, "tokens_per_min": 1000000000}}
    (tenants / "bench.yaml").write_text(json.dumps(tenant))  # JSON is YAML
    pools = [
        # the gateway admits the engine's batch size and queues the rest by tier, keeping urgent_reserve of it from batch
        {"name": "priority", "model": MODEL, "engine": {"kind": "vllm", "schedule_policy": "priority"}, "replicas": {"urls": [vllm_url]},
         "max_in_flight_per_replica": max_num_seqs},
        {"name": "flat", "model": FLAT_MODEL, "engine": {"kind": "vllm"}, "replicas": {"urls": [vllm_url]}},
    ]
    config = {"server": {"host": "127.0.0.1"}, "upstream": {"first_byte_timeout_s": 300, "response_timeout_s": 300, "between_chunks_timeout_s": 120},
              "tenants_dir": "tenants", "fleet": {"pools": pools}, "router": {"urgent_reserve": urgent_reserve, "urgent_window_s": urgent_window_s}}
    path = run_dir / "gateway.yaml"
    path.write_text(json.dumps(config))
    return path


@dataclass(frozen=True, slots=True)
class PhaseResult:
    name: str
    interactive: tuple[RequestRecord, ...]
    num_flood_done: int
    # Where interactive TTFT went: the gateway's queue (its /metrics, interactive tier) during the phase
    num_queued: int = 0
    queued_s: float = 0.0
    batch_first_tokens_at: tuple[float, ...] = ()  # when each batch answer's first token came (its prefill had run)

    def ttfts_beside_batch_prefill_s(self) -> tuple[list[float], list[float]]:
        """The interactive TTFTs during which a batch request's first token came (its prefill shared the
        engine's steps), and the others."""
        beside: list[float] = []
        clear: list[float] = []
        for r in self.interactive:
            if r.ttft_s is None or r.error:
                continue
            hit = any(r.sent_at_s < at <= r.sent_at_s + r.ttft_s for at in self.batch_first_tokens_at)
            (beside if hit else clear).append(r.ttft_s)
        return beside, clear

    @property
    def ttfts_s(self) -> list[float]:
        return [r.ttft_s for r in self.interactive if r.ttft_s is not None and not r.error]

    @property
    def num_failed(self) -> int:
        return sum(1 for r in self.interactive if r.error or r.ttft_s is None)


@dataclass(frozen=True, slots=True)
class Settings:
    num_interactive: int
    interactive_every_s: float
    interactive_max_tokens: int
    flood_concurrency: int
    flood_max_tokens: int
    flood_warmup_s: float
    num_rounds: int = 1



def _request(index: int, model: str, tier: str, text: str, max_tokens: int) -> PreparedRequest:
    spec = RequestSpec(arrival_s=0.0, input_tokens=0, output_tokens=max_tokens, tier=tier, text=text)
    return prepare(index, spec, text, model, True, API_KEY)


async def _flood(session: aiohttp.ClientSession, url: str, model: str, settings: Settings, done: list[RequestRecord]) -> None:
    """One closed-loop batch client: send, wait for the whole answer, send again, until cancelled."""
    loop = asyncio.get_running_loop()
    index = 0
    while True:
        record = await send(session, url, _request(index, model, "batch", _BATCH_TEXT, settings.flood_max_tokens), loop.time(), loop.time)
        index += 1
        if not record.error:
            done.append(record)


async def _interactive_queue(session: aiohttp.ClientSession, gateway_url: str) -> tuple[int, float]:
    """Interactive requests the gateway has queued so far (all pools), and their seconds in its queues."""
    async with session.get(gateway_url + "/metrics") as resp:
        text = await resp.text()

    def total(name: str) -> float:
        return sum(float(m[1]) for m in re.finditer(rf'^{name}\{{[^}}]*tier="interactive"[^}}]*\}} (\S+)$', text, re.M))

    return int(total("polymorph_pool_queue_wait_seconds_count")), total("polymorph_pool_queue_wait_seconds_sum")


async def _phase(session: aiohttp.ClientSession, url: str, name: str, model: str, flood: bool, settings: Settings,
                 num_interactive: int) -> PhaseResult:
    loop = asyncio.get_running_loop()
    gateway_url = url.removesuffix("/v1/chat/completions")
    queued_before = await _interactive_queue(session, gateway_url)
    done: list[RequestRecord] = []
    flooders = [asyncio.create_task(_flood(session, url, model, settings, done)) for _ in range(settings.flood_concurrency if flood else 0)]
    try:
        if flood:
            await asyncio.sleep(settings.flood_warmup_s)  # let the engine's queue fill
        start = loop.time()
        sends = []
        for i in range(num_interactive):
            await asyncio.sleep(max(0.0, start + i * settings.interactive_every_s - loop.time()))
            request = _request(i, model, "interactive", _INTERACTIVE_TEXT, settings.interactive_max_tokens)
            sends.append(asyncio.create_task(send(session, url, request, loop.time(), loop.time)))
        records = await asyncio.gather(*sends)
    finally:
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    queued_after = await _interactive_queue(session, gateway_url)
    first_tokens_at = tuple(r.sent_at_s + r.ttft_s for r in done if r.ttft_s is not None)
    return PhaseResult(name, tuple(records), len(done), queued_after[0] - queued_before[0], queued_after[1] - queued_before[1], first_tokens_at)


async def _engine_idle(session: aiohttp.ClientSession, vllm_url: str, timeout_s: float = 60.0) -> None:
    """Wait until the engine runs and queues nothing (cancelled flood requests have left it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        async with session.get(vllm_url + "/metrics") as resp:
            load = parse_load("vllm", await resp.text(), loop.time())
        if load.num_requests == 0:
            # the gateway reads /metrics each second: until it has read the engine idle, the flood it last
            # saw through the other pool counts as foreign load on this one (fleet.foreign_load)
            await asyncio.sleep(2.0)
            return
        await asyncio.sleep(0.2)


def _merged(parts: Sequence[PhaseResult]) -> PhaseResult:
    return PhaseResult(parts[0].name, tuple(r for p in parts for r in p.interactive), sum(p.num_flood_done for p in parts),
                       sum(p.num_queued for p in parts), sum(p.queued_s for p in parts), tuple(t for p in parts for t in p.batch_first_tokens_at))


async def _run_phases(gateway_url: str, vllm_url: str, settings: Settings) -> list[PhaseResult]:
    """The three phases, in ``num_rounds`` rounds of a share of the interactive requests each, side by side:
    a host whose other load drifts during the run weighs on every phase alike."""
    url = gateway_url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        # one warm-up request per model, so the first measured TTFT is not the engine's first request
        loop = asyncio.get_running_loop()
        for model in (MODEL, FLAT_MODEL):
            await send(session, url, _request(0, model, "interactive", _INTERACTIVE_TEXT, 2), loop.time(), loop.time)
        parts: dict[str, list[PhaseResult]] = {name: [] for name in PHASES}
        for round_index in range(settings.num_rounds):
            count = settings.num_interactive // settings.num_rounds + (round_index < settings.num_interactive % settings.num_rounds)
            for name, model, flood in zip(PHASES, (MODEL, MODEL, FLAT_MODEL), (False, True, True), strict=True):
                _say(f"bench priority: round {round_index + 1}/{settings.num_rounds}, phase {name!r} ...")
                await _engine_idle(session, vllm_url)  # cancelled flood requests leave the engine
                parts[name].append(await _phase(session, url, name, model, flood, settings, count))
        return [_merged(parts[name]) for name in PHASES]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ms(value: float | None) -> str:
    return f"{value * 1000:9.1f}" if value is not None else f"{'-':>9}"


def report(results: Sequence[PhaseResult], settings: Settings, max_num_seqs: int, urgent_reserve: float) -> dict[str, object]:
    """Print the table; return the JSON line's object."""
    print(f"{'phase':<20} {'n':>3} {'failed':>6} {'ttft p50 ms':>11} {'ttft p99 ms':>11} {'ttft max ms':>11} {'flood done':>10} "
          f"{'queued':>6} {'queue ms':>9}")
    p99: dict[str, float | None] = {}
    for result in results:
        stats = percentiles(result.ttfts_s)
        p99[result.name] = stats["p99"]
        worst = max(result.ttfts_s) if result.ttfts_s else None
        print(f"{result.name:<20} {len(result.interactive):3d} {result.num_failed:6d} {_ms(stats['p50']):>11} {_ms(stats['p99']):>11} "
              f"{_ms(worst):>11} {result.num_flood_done:10d} {result.num_queued:6d} {_ms(result.queued_s / result.num_queued if result.num_queued else None)}")
    for result in results[1:]:  # which interactive requests shared the engine with a batch request's prefill
        beside, clear = result.ttfts_beside_batch_prefill_s()
        print(f"{result.name}: {len(beside)} interactive TTFTs beside a batch prefill (max {_ms(max(beside, default=None)).strip()} ms), "
              f"{len(clear)} without (max {_ms(max(clear, default=None)).strip()} ms); all, sorted: "
              f"{' '.join(f'{t * 1000:.0f}' for t in sorted(result.ttfts_s))}")
    for result in results:  # what a failure was (a 429 shed from the gateway's queue, say), so a run is read honestly
        for record in result.interactive:
            if record.error or record.ttft_s is None:
                print(f"{result.name}: interactive request {record.index} failed: {record.status} {record.error[:200]}")
    alone, prioritised, flat = (p99[name] for name in PHASES)
    return {
        "bench": "priority",
        "ttft_p99_s": {name: round(v, 4) if v is not None else None for name, v in p99.items()},
        "flood_priority_over_alone": _ratio(prioritised, alone),
        "flood_no_priority_over_alone": _ratio(flat, alone),
        "no_priority_over_priority": _ratio(flat, prioritised),
        "failed": sum(r.num_failed for r in results),
        "interactive_queued": {r.name: r.num_queued for r in results},
        "interactive_queue_s": {r.name: round(r.queued_s, 4) for r in results},
        "settings": {"num_interactive": settings.num_interactive, "interactive_every_s": settings.interactive_every_s,
                     "flood_concurrency": settings.flood_concurrency, "flood_max_tokens": settings.flood_max_tokens,
                     "max_num_seqs": max_num_seqs, "urgent_reserve": urgent_reserve, "num_rounds": settings.num_rounds},
        "ttfts_ms": {r.name: [round(t.ttft_s * 1000) if t.ttft_s is not None else None for t in r.interactive] for r in results},
    }


def main_bench(args: argparse.Namespace) -> int:
    from fleet.engines import install

    python = Path(args.vllm_python) if args.vllm_python else install.vllm_python()
    model_dir = Path(args.model_dir) if args.model_dir else install.tiny_model_hf()
    if args.rounds < 1 or args.interactive < args.rounds:
        raise SystemExit(f"polymorph bench priority: --rounds must be between 1 and --interactive ({args.interactive}), got {args.rounds}")
    settings = Settings(args.interactive, args.interactive_every, args.interactive_max_tokens, args.flood_concurrency,
                        args.flood_max_tokens, args.flood_warmup, args.rounds)
    with ExitStack() as stack:
        run_dir = Path(args.run_dir) if args.run_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polymorph-bench-priority-")))
        run_dir.mkdir(parents=True, exist_ok=True)
        vllm_port, gateway_port = procs.free_port(), procs.free_port()
        vllm_url, gateway_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{gateway_port}"
        _say(f"bench priority: starting vLLM (--scheduling-policy priority --max-num-seqs {args.max_num_seqs}), about 40 s ...")
        stack.enter_context(_child(_vllm_argv(python, model_dir, vllm_port, args.max_num_seqs), vllm_url + "/health",
                                   run_dir / "vllm.log", args.start_timeout, _VLLM_ENV))
        config = _write_gateway_config(run_dir, vllm_url, args.max_num_seqs, args.urgent_reserve, args.urgent_window)
        gateway_argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(gateway_port), "--no-access-log"]
        stack.enter_context(_child(gateway_argv, gateway_url + "/readyz", run_dir / "gateway.log", 60.0))
        results = asyncio.run(_run_phases(gateway_url, vllm_url, settings))
    summary = report(results, settings, args.max_num_seqs, args.urgent_reserve)
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["failed"] == 0 else 1
