"""State files that break: the decision log (corrupted, then unwritable, under load) and the trial store
(corrupted, locked, full). The gateway keeps serving, the error is reported, nothing is silently lost.

Decision log: the gateway (controller on) starts on a log with corrupted lines, which it skips and
counts; then the file is replaced by a directory while the controller is deciding, so every write
fails (``GET /admin/decisions`` says why and how many lines are queued); then the directory goes and
the queued lines must reach the file. Trial store: each broken store is handed to the compiler,
in-process and through ``polymorph compile``, which must answer with a ``StoreError`` (a clear
message and exit status 1), and a full store must keep every trial it had.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kernels.catalog import get_gpu, get_model
from kernels.compiler.evaluators import Metrics
from kernels.compiler.shape import get_shape
from kernels.compiler.store import Fingerprints, StoreError, TrialStore
from kernels.config import EngineConfig
from loadtest.chaos.fleet_faults import ControllerStack, FleetFaultSettings, load_until, long_request
from loadtest.chaos.load import OK, percentile
from loadtest.chaos.report import Check, ScenarioResult, summarize
from loadtest.chaos.stack import POLYMORPH

_GOOD = json.dumps({"at_unix_s": 1.0, "kind": "plan", "evidence": {"reason": "written before the crash"}})
_CORRUPT = (_GOOD, '{"at_unix_s": 2.0, "kind": "st', "\x00\x00\x00", "[]", _GOOD)  # a torn write, zeros, not a decision
NUM_CORRUPT = 3


def _log_state(stack: ControllerStack) -> tuple[list[dict[str, object]], dict[str, object]]:
    answer = stack.admin("/admin/decisions?limit=10000")
    return answer["decisions"], answer["log"]


async def broken_decision_log(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "decisions.jsonl"
    path.write_text("\n".join(_CORRUPT) + "\n")
    with ControllerStack((("mixed", 2, ("short-chat",)),), run_dir) as stack:
        entries, opened = _log_state(stack)
        path.rename(run_dir / "decisions.before.jsonl")
        path.mkdir()  # every append fails from now on (IsADirectoryError): the log must queue, not lose
        outage: dict[str, object] = {}

        def outage_then_restored() -> bool:
            entries_now, log = _log_state(stack)
            if not outage:
                if log["write_error"] and len(entries_now) > len(entries):
                    outage.update(log, num_entries=len(entries_now))
                    shutil.rmtree(path)  # the operator fixes it: the next decision writes the queued lines
                return False
            return log["write_error"] is None and log["unwritten"] == 0

        # long prompts into a pool declared for short chats: the controller plans a move, so decisions keep
        # coming (drift, plan, step, verify) while the log refuses writes and after it takes them again
        answers, restored_s, retried = await load_until(stack, settings, outage_then_restored, long_request)
        entries_after, log_after = _log_state(stack)
    # a decision is its time, kind and evidence (a line may carry more, such as the model it is about)
    def key(entry: dict[str, object]) -> tuple[object, ...]:
        return tuple(json.dumps(entry.get(k), sort_keys=True) for k in ("at_unix_s", "kind", "evidence"))

    written = {key(json.loads(line)) for line in path.read_text().splitlines()} if path.is_file() else set()
    missing = [e["kind"] for e in entries_after[len(entries):] if key(e) not in written]
    failed = [a for a in answers if a.verdict != OK]
    ok = [a.latency_s for a in answers if a.verdict == OK]
    checks = [
        Check("corrupted lines skipped and counted", opened["skipped_lines"] == NUM_CORRUPT and len(entries) == 2,
              f"skipped {opened['skipped_lines']}, read back {len(entries)}"),
        Check("unwritable log reported", bool(outage.get("write_error")) and int(outage.get("unwritten", 0)) > 0,  # type: ignore[call-overload]
              f"log state during the outage: {outage or 'no decision was made'}"),
        Check("queued lines written once it could", restored_s > 0 and not missing and log_after["dropped"] == 0,
              f"restored after {restored_s:.1f} s; missing from the file: {missing}"),
        Check("every request succeeded", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
    ]
    return summarize("broken-decision-log", answers, retried, percentile(ok, 0.5), checks,
                     {"queued_during_outage": float(outage.get("unwritten", 0)), "restored_after_s": restored_s,  # type: ignore[arg-type]
                      "p99_ms": percentile(ok, 0.99) * 1000})


# --- trial store -------------------------------------------------------------------------------

_MODEL, _GPU = get_model("llama-3.1-8b"), get_gpu("H100-SXM")
_FPS = Fingerprints("m", "h")
_METRICS = Metrics(2.0, 2.0, 100.0, 0.5, 0.02, 0.3, 0.4, "memory-bound")


def _record(store: TrialStore, note: str) -> int:
    return store.record_trial("chaos", time.time(), _MODEL, _GPU, 1, _FPS, get_shape("short-chat"), "analytic", "chaos",
                              EngineConfig(), [], _METRICS, note)


def _expect_store_error(action: Callable[[], object], needle: str) -> tuple[bool, str]:
    try:
        action()
    except StoreError as exc:
        return needle in str(exc), str(exc)
    except Exception as exc:  # noqa: BLE001 - anything but a StoreError is the caller crashing on a broken store
        return False, f"{type(exc).__name__}: {exc}"
    return False, "no error: the write was accepted or silently dropped"


def _full(path: Path) -> tuple[bool, str]:
    """SQLite refuses to grow past max_page_count exactly as past a full disk ("database or disk is full")."""
    with TrialStore(path) as store:
        kept = [_record(store, f"before-{k}") for k in range(3)]
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]  # no other way to fill a store without filling a disk
        store._db.execute(f"PRAGMA max_page_count = {pages}")

        def flood() -> None:
            for k in range(10_000):
                _record(store, "x" * 4000 + str(k))

        clear, message = _expect_store_error(flood, "is full")
    with TrialStore(path) as store:
        notes = [t.note for t in store.trials(_MODEL.name, _GPU.name, 1)]
    intact = notes[: len(kept)] == [f"before-{k}" for k in range(3)]
    return clear and intact, message if intact else f"earlier trials lost: {notes[:3]}"


def _locked(path: Path) -> tuple[bool, str]:
    TrialStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with TrialStore(path, busy_timeout_s=0.2) as store:
            return _expect_store_error(lambda: _record(store, "locked"), "locked")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def _corrupt(path: Path) -> tuple[bool, str]:
    path.write_bytes(b"not a database " * 200)
    return _expect_store_error(lambda: TrialStore(path), "not a readable SQLite trial store")


def _corrupt_cli(path: Path) -> tuple[bool, str]:
    path.write_bytes(b"\x00garbage" * 500)
    argv = [*POLYMORPH, "compile", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--shape", "short-chat",
            "--budget", "2", "--store", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    clear = done.returncode == 1 and "not a readable SQLite trial store" in done.stderr and "Traceback" not in done.stderr
    return clear, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}, no message"


STORE_FAULTS: dict[str, Callable[[Path], tuple[bool, str]]] = {
    "corrupt": _corrupt, "locked": _locked, "full": _full, "corrupt via polymorph compile": _corrupt_cli,
}


async def broken_trial_store(run_dir: Path) -> ScenarioResult:
    """Each broken store is one "request" to the compiler: a clear StoreError is the only right answer."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checks = []
    for name, fault in STORE_FAULTS.items():
        clear, detail = await asyncio.to_thread(fault, run_dir / f"{name.replace(' ', '-')}.sqlite3")
        checks.append(Check(f"{name}: clear StoreError, nothing lost", clear, detail))
    num_clear = sum(c.passed for c in checks)
    return ScenarioResult("broken-trial-store", len(checks), 0, 0, num_clear, len(checks) - num_clear, 0.0, tuple(checks),
                          lost_reasons=tuple(c.detail for c in checks if not c.passed))
