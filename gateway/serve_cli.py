"""`polymorph serve`: run the gateway (one process or several on one port) in front of a fleet."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gateway import controller_cli
from gateway.config import GatewayConfig, PoolSpec
from gateway.listen import hold_address
from kernels.argtypes import count, http_url, port
from loadtest.demo_credentials import DEMO_ADMIN_TOKEN, DEMO_API_KEY

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.synchronize import Semaphore

    from gateway.limits_shared import WorkerLimits
    from gateway.live_fleet import LiveFleet
    from gateway.plan_client import PlanClient
    from gateway.replicas import ReplicaControl
    from gateway.state import FleetLink, GatewayState


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway",
        description=(
            "Run the gateway. With --config it serves the pools, tenants and shapes of that file and starts "
            "the replicas it declares (`replicas: {launch: N}`: emulated, or real sglang, vLLM or llama.cpp "
            "engines on fleet.devices; the CPU engines are installed on first use, see `polymorph engines`); "
            "with --upstream URL (repeatable) and no config it serves one "
            f"pool of those replicas (models discovered from their /v1/models) to the demo tenant "
            f"(API key {DEMO_API_KEY}, admin token {DEMO_ADMIN_TOKEN}: demo-only)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="gateway config file (see config.example.yaml)")
    source.add_argument("--upstream", action="append", type=http_url, metavar="URL", help="an OpenAI-compatible replica (repeat for more)")
    p.add_argument("--host", help="listen address (default: the config's server.host, else 127.0.0.1)")
    p.add_argument("--port", type=port, help="listen port (default: the config's server.port, else 8080)")
    p.add_argument("--workers", type=count, default=1, help="gateway processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--no-access-log", action="store_true", help="do not write the JSON access log to stderr")
    p.add_argument("--replica-logs", type=Path, help="where launched replicas write their logs (default: a temp dir)")
    p.set_defaults(handler=_run_serve)
    controller_cli.register(commands)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """No `polymorph bench` entries: the gateway's benchmarks and chaos suite are the load tester's (loadtest/cli.py)."""


def _load(args: argparse.Namespace) -> GatewayConfig:
    from dataclasses import replace

    from gateway.config import load_config, upstream_only_config

    if args.config is not None:
        config = load_config(args.config)
    else:
        config = upstream_only_config(args.upstream, args.host or "127.0.0.1", args.port or 8080)
    server = config.server
    server = replace(server, host=args.host or server.host, port=args.port if args.port is not None else server.port)
    if args.no_access_log:
        server = replace(server, access_log=False)
    return replace(config, server=server)


def _start_fleet(config: GatewayConfig, log_dir: Path | None) -> tuple[ReplicaControl | None, dict[str, list[str]]]:
    """Start the emulated replicas the config declares (as ``fleet.actuator`` says); returns their
    control (None: there are none to run here) and pool -> URLs."""
    from gateway.replicas import EMULATE_COMMAND, replica_control, start_fleet

    external = config.controller.enabled and config.controller.mode == "external"
    if external or not any(p.num_launched for p in config.pools):  # an external controller runs them
        return None, {}
    control = replica_control(config, EMULATE_COMMAND, log_dir or Path(tempfile.mkdtemp(prefix="polymorph-replicas-")))
    return control, start_fleet(control, config, _adopted_configs(config))


def _adopted_configs(config: GatewayConfig) -> dict[str, str]:
    """Per launched pool, the configuration a canary adopted for it before this start (fleet.adoptions), read
    from the decision log; each is said on stderr. An unreadable log restores nothing, and says why."""
    from fleet.adoptions import adopted_configs
    from fleet.decisions import read_log

    path = config.controller.decision_log
    if path is None or not path.is_file():
        return {}
    try:
        decisions = read_log(path)
    except OSError as exc:
        print(f"polymorph: cannot read the decision log {path} ({exc}); pools start on their declared configurations", file=sys.stderr)
        return {}
    found = adopted_configs(decisions, {p.name: p.config_json for p in config.pools if p.num_launched})
    for adoption in sorted(found.values(), key=lambda a: a.pool):
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(adoption.adopted_at_unix_s))
        print(f"polymorph: pool {adoption.pool} starts on the configuration its canary adopted at {when} "
              f"({adoption.num_adoptions} adoption(s) on top of the declared one, decision log {path}): {adoption.config_json}",
              file=sys.stderr, flush=True)
    return {pool: adoption.config_json for pool, adoption in found.items()}


def _raise_open_file_limit() -> None:
    """Each stream holds two sockets (client and replica): use all the descriptors the system allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _serve(
    config: GatewayConfig,
    replica_urls: dict[str, list[str]],
    config_path: Path | None,
    live_fleet: Callable[[GatewayState], FleetLink] | None = None,
    shared_port: bool = False,
    on_listening: Callable[[], None] | None = None,
) -> None:
    from aiohttp import web

    from gateway.malformed_http import EnvelopeAppRunner

    _raise_open_file_limit()

    from gateway.app import STATE_KEY, build_app
    from gateway.reload import ConfigWatcher

    app = build_app(config, replica_urls, live_fleet)
    limit_store = app[STATE_KEY].runtime.limit_store
    if limit_store is not None:
        limit_store.bind_metrics(app[STATE_KEY].metrics.registry)
    runner = EnvelopeAppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    # SO_REUSEPORT only among `--workers` siblings: a lone gateway must fail on a port in use (say, another
    # gateway's), not silently share its connections with whatever holds it.
    site = web.TCPSite(runner, config.server.host, config.server.port, backlog=4096, reuse_port=shared_port)
    # The handlers go in before the socket listens and the caller hears of it after: whoever starts serving on
    # "serving on" (a script, make run's user) can send a request or a Ctrl-C at once and have it honoured.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await site.start()
    watcher = ConfigWatcher(app[STATE_KEY], config_path) if config_path is not None else None
    if watcher is not None:
        watcher.start()
    if on_listening is not None:
        on_listening()
    await stop.wait()
    if watcher is not None:
        await watcher.stop()
    await runner.cleanup()
    if limit_store is not None:
        from gateway.budgets_store import StoreSpendLedger

        if isinstance(spend := app[STATE_KEY].runtime.spend, StoreSpendLedger):
            await spend.close()  # the last charges reach the store before its client closes
        await limit_store.close()


def _run_worker(
    config: GatewayConfig,
    replica_urls: dict[str, list[str]],
    config_path: Path | None,
    live_fleet: Callable[[GatewayState], FleetLink] | None = None,
    worker_limits: WorkerLimits | None = None,
    listening: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; ``listening`` is called once the socket listens."""
    import uvloop

    from gateway.limits_shared import attach_process, detach_process

    if worker_limits is not None:  # one of `--workers N`: the tenants' limits are shared with the siblings
        attach_process(worker_limits)
    try:
        uvloop.run(_serve(config, replica_urls, config_path, live_fleet or _plan_client_factory(config), shared_port=worker_limits is not None,
                          on_listening=listening))
    finally:
        detach_process()


def _run_spawned_worker(config: GatewayConfig, replica_urls: dict[str, list[str]], config_path: Path | None, worker_limits: WorkerLimits,
                        listening: Semaphore) -> None:
    """One of `--workers N` (a spawned process: the semaphore travels whole, its bound ``release`` would not)."""
    _run_worker(config, replica_urls, config_path, None, worker_limits, listening.release)


def _all_listening(workers: list[BaseProcess], listening: Semaphore, num_workers: int) -> bool:
    """Whether every worker said it listens (False as soon as one has exited without saying so)."""
    heard = 0
    while heard < num_workers:
        if listening.acquire(timeout=0.2):
            heard += 1
        elif not all(worker.is_alive() for worker in workers):
            return False
    return True


def _plan_client_factory(config: GatewayConfig) -> Callable[[GatewayState], PlanClient] | None:
    """Each gateway process's link to an external controller (fleet.controller.mode: external)."""
    if not (config.controller.enabled and config.controller.mode == "external"):
        return None

    def build(state: GatewayState) -> PlanClient:
        from gateway.plan_client import PlanClient

        return PlanClient(state, config.controller, config.emulator_speed)

    return build


def _live_fleet_factory(config: GatewayConfig, control: ReplicaControl | None) -> Callable[[GatewayState], FleetLink] | None:
    """The loop over the replicas this gateway launched: operator moves always, the fleet controller
    when the config enables it in the gateway and the performance model knows its models and GPUs.
    Without launched replicas, an enabled controller models the ``urls`` pools it can price."""
    if config.controller.enabled and config.controller.mode == "external":
        return None
    if control is None:
        return _pool_modeller_factory(config) if config.controller.enabled else None
    launched = [p for p in config.pools if p.num_launched]
    settings = config.controller
    unknown = _uncatalogued(launched)
    if settings.enabled and unknown:
        print(f"polymorph: fleet.controller plans with the performance model, which does not know {unknown}; "
              "the controller is off (POST /admin/move still moves replicas)", file=sys.stderr)
        settings = dataclasses.replace(settings, enabled=False)

    def build(state: GatewayState) -> LiveFleet:
        from gateway.live_fleet import LiveFleet

        live = LiveFleet(state, control, tuple(sorted({p.model for p in launched})), config.emulator_speed, settings)
        live.adopt()
        return live

    return build


def _pool_modeller_factory(config: GatewayConfig) -> Callable[[GatewayState], FleetLink] | None:
    """The capacity model of the ``urls`` pools an enabled controller cannot move (gateway.pool_modeller);
    None, said on stderr, when the performance model can price none of them."""
    from gateway.pool_modeller import PoolModeller, modelled_pools

    model_to_pools = modelled_pools(config)
    if not model_to_pools:
        print("polymorph: fleet.controller is enabled, but no pool is launched and no urls pool names a GPU kind and model the "
              "performance model knows: nothing to plan or model", file=sys.stderr)
        return None
    names = [d.name for pools in model_to_pools.values() for d in pools]
    print(f"polymorph: fleet.controller models the urls pools {', '.join(names)} for routing (it moves no replica: none is launched)",
          file=sys.stderr)
    # fleet time: emulated urls (engine kind: emulated) at the emulator's speed; with any real engine, wall time
    speed = 1.0 if any(spec.real for spec in config.pools if spec.name in names) else config.emulator_speed

    def build(state: GatewayState) -> FleetLink:
        return PoolModeller(state, tuple(model_to_pools), speed, config.controller)

    return build


def _uncatalogued(pools: list[PoolSpec]) -> str:
    """The first model or GPU kind of ``pools`` the catalog lacks, as words ("" when it knows them all)."""
    from kernels.catalog import get_gpu, get_model

    for pool in pools:
        for what, name, lookup in (("model", pool.model, get_model), ("GPU", pool.gpu or "", get_gpu)):
            try:
                lookup(name)
            except ValueError:
                return f"the {what} {name!r} of pool {pool.name!r}"
    return ""


def _run_serve(args: argparse.Namespace) -> int:
    from classifiers.request import ClassifierLoadError
    from kernels.yamlsrc import ConfigError

    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"polymorph: invalid config: {exc}", file=sys.stderr)
        return 2
    where = f"http://{config.server.host}:{config.server.port}"
    try:
        held = hold_address(config.server.host, config.server.port)
    except OSError as exc:
        print(f"polymorph: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    control, replica_urls = _start_fleet(config, args.replica_logs)
    config_path = args.config.absolute() if args.config is not None else None  # not resolved: see load_config

    def announce() -> None:
        if held is not None:
            held.close()  # the gateway listens on its address now
        print(f"polymorph: serving on {where} with {args.workers} worker(s); pools: {', '.join(p.name for p in config.pools)}",
              file=sys.stderr, flush=True)

    try:
        if args.workers <= 1:
            _run_worker(config, replica_urls, config_path, _live_fleet_factory(config, control), listening=announce)
            return 0
        if config.controller.enabled and config.controller.mode == "embedded":
            print("polymorph: the embedded fleet.controller runs only with --workers 1 (use mode: external and "
                  "`polymorph controller`); serving the configured pools as they are", file=sys.stderr)
        return _run_workers(args.workers, config, replica_urls, config_path, announce)
    except ClassifierLoadError as exc:
        print(f"polymorph: cannot load the classifier: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"polymorph: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if held is not None:
            held.close()
        if control is not None:
            from gateway.replicas import close

            close(control)


def _run_workers(num_workers: int, config: GatewayConfig, replica_urls: dict[str, list[str]], config_path: Path | None,
                 announce: Callable[[], None]) -> int:
    from gateway.limits_shared import SharedLimitTable, WorkerLimits
    from gateway.metrics import MULTIPROC_ENV

    metrics_dir = tempfile.mkdtemp(prefix="polymorph-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the spawned workers
    # One table of tenants' budgets for all the workers (unless a store shared by several hosts holds them):
    # else each worker would grant every tenant its whole limit, N workers N times it.
    table = SharedLimitTable.create() if config.limits.store is None else None
    try:
        return _spawn_workers(num_workers, config, replica_urls, config_path, metrics_dir,
                              WorkerLimits(num_workers, table.handle if table is not None else None), announce)
    finally:
        if table is not None:
            table.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _spawn_workers(num_workers: int, config: GatewayConfig, replica_urls: dict[str, list[str]], config_path: Path | None, metrics_dir: str,
                   worker_limits: WorkerLimits, announce: Callable[[], None]) -> int:
    from prometheus_client import multiprocess

    ctx = multiprocessing.get_context("spawn")
    listening = ctx.Semaphore(0)  # each worker releases it once its socket listens
    workers = [ctx.Process(target=_run_spawned_worker, args=(config, replica_urls, config_path, worker_limits, listening), daemon=False)
               for _ in range(num_workers)]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    if _all_listening(workers, listening, num_workers):
        announce()
    for worker in workers:
        worker.join()
        if worker.pid is not None:
            multiprocess.mark_process_dead(worker.pid, metrics_dir)
    return max((w.exitcode or 0) for w in workers)
