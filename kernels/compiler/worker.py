"""Run compilations off the request path: in a worker process with its own CPU budget.

The fleet controller submits a `CompileRequest` (plain values, picklable) and polls or awaits the
future; the worker opens the trial store by path (SQLite connections do not cross processes)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from dataclasses import dataclass

from kernels.compiler.evaluators import evaluator_by_name
from kernels.compiler.search import Budget, CompileResult, compile_config
from kernels.compiler.shape import TrafficShape
from kernels.compiler.store import TrialStore


@dataclass(frozen=True, slots=True)
class CompileRequest:
    model: str
    gpu: str
    num_gpus: int
    shape: TrafficShape | str
    objective: str = "goodput"
    budget: Budget = Budget()
    store_path: str | None = None
    engine_version: str = "unknown"
    evaluator: str = "perf-model"  # or "analytic" (closed-form screening, milliseconds a trial)


def run_compile(request: CompileRequest) -> CompileResult | None:
    """Compile in this process (the worker's entry point; also usable directly)."""
    evaluator = evaluator_by_name(request.evaluator)
    if request.store_path is None:
        return compile_config(request.model, request.gpu, request.num_gpus, request.shape, request.objective,
                              request.budget, evaluator=evaluator, engine_version=request.engine_version)
    with TrialStore(request.store_path) as store:
        return compile_config(request.model, request.gpu, request.num_gpus, request.shape, request.objective,
                              request.budget, store=store, evaluator=evaluator, engine_version=request.engine_version)


def _lower_priority() -> None:
    # The gateway's event loop shares the machine; the search yields the CPU to it.
    os.nice(10)


def background_process_pool(max_workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """Worker processes for CPU-heavy model work beside a gateway: spawned (a fork would copy the
    gateway's event loop and sockets) and niced (the request path keeps the CPU)."""
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=max_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_lower_priority)


class CompileWorker:
    """A pool of `max_workers` compile processes (spawned, niced). Use as a context manager or
    call `close()`; `submit` returns a concurrent.futures.Future (wrap with asyncio.wrap_future)."""

    def __init__(self, max_workers: int = 1) -> None:
        self._pool = background_process_pool(max_workers)

    def submit(self, request: CompileRequest) -> concurrent.futures.Future[CompileResult | None]:
        return self._pool.submit(run_compile, request)

    def close(self, cancel_pending: bool = True) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel_pending)

    def terminate(self) -> None:
        """Stop at once (a gateway shutting down): pending compiles are cancelled and running ones
        killed; the trials they finished are already in the store."""
        terminate_process_pool(self._pool)

    def __enter__(self) -> CompileWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def terminate_process_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Cancel what is pending and kill the workers now: a caller waiting on a running task gets
    BrokenProcessPool instead of the result. ProcessPoolExecutor has no public way to kill its workers
    before Python 3.14 (`terminate_workers`), hence its process table."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10.0)
