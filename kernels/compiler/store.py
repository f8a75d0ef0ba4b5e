"""The persistent trial store: every trial and compiled artefact, in SQLite.

WAL mode and `BEGIN IMMEDIATE` transactions make it safe for several gateways (processes) writing at
once; a busy database is waited for (`busy_timeout_s`), then reported. A file that is not a trial
store, a locked one or a full one raises `StoreError` naming the path: a trial is never dropped silently.

Each trial carries three fingerprints: the traffic shape's, the model's (digest of its config) and
the hardware's (GPU kind, count, driver and engine versions when known). A trial whose model or
hardware fingerprint no longer matches is *stale*: it may seed a search, but its metrics are not
reused without being evaluated again."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.evaluators import Metrics
from kernels.compiler.measurement import Measurement, ProbeCorrection, ProbeFingerprint
from kernels.compiler.shape import TrafficShape, shape_fingerprint
from kernels.config import EngineConfig

T = TypeVar("T")
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, created_at REAL NOT NULL,
    model TEXT NOT NULL, model_fp TEXT NOT NULL, gpu TEXT NOT NULL, num_gpus INTEGER NOT NULL, hardware_fp TEXT NOT NULL,
    shape_name TEXT NOT NULL, shape_fp TEXT NOT NULL, shape_json TEXT NOT NULL,
    evaluator TEXT NOT NULL, proposer TEXT NOT NULL, config_json TEXT NOT NULL, config_key TEXT NOT NULL,
    status TEXT NOT NULL, gates_json TEXT NOT NULL, metrics_json TEXT, note TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS trials_lookup ON trials (model, gpu, num_gpus, evaluator, status);
CREATE TABLE IF NOT EXISTS artefacts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, created_at REAL NOT NULL,
    model TEXT NOT NULL, model_fp TEXT NOT NULL, gpu TEXT NOT NULL, num_gpus INTEGER NOT NULL, hardware_fp TEXT NOT NULL,
    shape_name TEXT NOT NULL, shape_fp TEXT NOT NULL, evaluator TEXT NOT NULL, objective TEXT NOT NULL,
    config_json TEXT NOT NULL, metrics_json TEXT NOT NULL, baseline_json TEXT NOT NULL,
    num_trials INTEGER NOT NULL, warm_start INTEGER NOT NULL, reason TEXT NOT NULL, engine_version TEXT NOT NULL,
    pools_json TEXT NOT NULL DEFAULT '[]'
);
"""
# Measured trials (the probe evaluator): the model's prediction beside the measurement, and what it ran on.
# Added after schema 1 without a version bump: created on the first probe write, so older stores open
# unchanged and older readers ignore the table.
_PROBE_SCHEMA = """
CREATE TABLE IF NOT EXISTS probe_trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, created_at REAL NOT NULL,
    model TEXT NOT NULL, model_fp TEXT NOT NULL, gpu TEXT NOT NULL, shape_name TEXT NOT NULL, shape_fp TEXT NOT NULL,
    measured_shape_json TEXT NOT NULL, config_json TEXT NOT NULL, config_key TEXT NOT NULL,
    predicted_json TEXT NOT NULL, measured_json TEXT NOT NULL, fingerprint_json TEXT NOT NULL, fingerprint TEXT NOT NULL,
    is_default INTEGER NOT NULL, chosen INTEGER NOT NULL
)
"""
# Fitted corrections of the performance model (`polymorph kernels fit --store`), created on the first
# fit like probe_trials; the newest row of a fingerprint and model is the one in force.
_CORRECTION_SCHEMA = """
CREATE TABLE IF NOT EXISTS probe_corrections (
    id INTEGER PRIMARY KEY AUTOINCREMENT, fingerprint TEXT NOT NULL, model TEXT NOT NULL, correction_json TEXT NOT NULL
)
"""


class StoreError(RuntimeError):
    """The trial store cannot be opened or written (corrupt, locked, wrong schema)."""


@dataclass(frozen=True, slots=True)
class Fingerprints:
    model: str
    hardware: str
    engine_version: str = "unknown"  # also inside `hardware`; kept readable for artefact listings


def model_fingerprint(model: ModelSpec) -> str:
    """Digest of the architecture (what config.json says), not of names and aliases."""
    values = {k: v for k, v in asdict(model).items() if k not in ("name", "aliases", "source", "drafts", "drafts_source")}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def hardware_fingerprint(gpu: GpuSpec, num_gpus: int, engine_version: str, evaluator_version: int) -> str:
    """What a trial's scores were measured on: the GPUs, the engine, and the evaluator's version (a
    simulated engine is the evaluator's). Trials written before evaluators had versions match none.
    The fourth field held a driver version that no caller ever gave ("unknown"); it stays in the digest
    so that stored fingerprints keep matching (a driver that matters belongs in ``engine_version``)."""
    text = json.dumps([gpu.name, num_gpus, engine_version, "unknown", evaluator_version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprints_for(model: ModelSpec, gpu: GpuSpec, num_gpus: int, engine_version: str, evaluator_version: int) -> Fingerprints:
    return Fingerprints(model_fingerprint(model), hardware_fingerprint(gpu, num_gpus, engine_version, evaluator_version), engine_version)


def config_key(config: EngineConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One row of the trials table. `metrics` is None for a rejected trial (see `gates`)."""

    trial_id: int
    run_id: str
    created_at: float
    model: str
    model_fp: str
    gpu: str
    num_gpus: int
    hardware_fp: str
    shape: TrafficShape
    shape_fp: str
    evaluator: str
    proposer: str
    config: EngineConfig
    status: str  # "evaluated" or "rejected"
    gates: tuple[tuple[str, str, str], ...]  # (gate, status, reason)
    metrics: Metrics | None
    note: str

    def is_fresh(self, fingerprints: Fingerprints) -> bool:
        return self.model_fp == fingerprints.model and self.hardware_fp == fingerprints.hardware


@dataclass(frozen=True, slots=True)
class ArtefactRecord:
    artefact_id: int
    run_id: str
    created_at: float
    model: str
    gpu: str
    num_gpus: int
    shape_name: str
    shape_fp: str
    evaluator: str
    objective: str
    config: EngineConfig
    metrics: Metrics
    baseline: Metrics
    num_trials: int
    warm_start: bool
    reason: str
    engine_version: str
    pools: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ProbeTrialRecord:
    """One row of probe_trials: a configuration measured on a real replica."""

    trial_id: int
    run_id: str
    model: str
    gpu: str
    shape_name: str
    shape_fp: str
    config: EngineConfig
    predicted: Metrics
    measured: Measurement
    fingerprint: ProbeFingerprint
    default: bool
    chosen: bool


class TrialStore:
    """SQLite-backed trial store at `path` (created when absent)."""

    def __init__(self, path: Path | str, busy_timeout_s: float = 30.0, create: bool = True) -> None:
        """``create=False`` (the commands that read or fit a store): a file without the store's tables is
        refused, not given them; before, `compile history --store other.db` added them to any SQLite file."""
        self.path = Path(path)
        if create:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the trial store's folder {self.path.parent}: {exc.strerror or exc}") from exc
        try:
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None)
            version = self._schema_version()
            if version is None and not create:
                raise StoreError(f"{self.path} is not a Polymorph trial store (it has none of its tables)")
            self._db.execute("PRAGMA journal_mode=WAL")  # kept in the file: a store is made WAL once
            self._db.execute("PRAGMA synchronous=NORMAL")
            if version is None:
                self._create_schema()
        except sqlite3.DatabaseError as exc:
            self.close()
            raise StoreError(_explain(self.path, exc)) from exc
        except StoreError:
            self.close()
            raise

    def _schema_version(self) -> int | None:
        """The schema version of an existing store (a read: opening a busy store needs no lock)."""
        exists = self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if exists else None
        if row is not None and int(row[0]) != SCHEMA_VERSION:
            raise StoreError(f"{self.path}: trial store schema {row[0]}, this Polymorph reads {SCHEMA_VERSION}")
        return None if row is None else int(row[0])

    def _create_schema(self) -> None:
        def create() -> None:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: trial store schema {row[0]}, this Polymorph reads {SCHEMA_VERSION}")

        self._transaction(create)

    def _transaction(self, body: Callable[[], T]) -> T:
        """Run `body` in one write transaction (taken up front, so concurrent writers queue)."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise StoreError(_explain(self.path, exc)) from exc
        try:
            result = body()
            self._db.execute("COMMIT")
            return result
        except sqlite3.Error as exc:
            self._roll_back()
            raise StoreError(_explain(self.path, exc)) from exc
        except BaseException:
            self._roll_back()
            raise

    def _roll_back(self) -> None:
        # SQLite has already rolled back after some errors (a full disk, for one): a second
        # ROLLBACK would raise and hide the StoreError that names the real problem.
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def record_trial(
        self, run_id: str, now: float, model: ModelSpec, gpu: GpuSpec, num_gpus: int, fingerprints: Fingerprints,
        shape: TrafficShape, evaluator: str, proposer: str, config: EngineConfig, gates: Sequence[tuple[str, str, str]],
        metrics: Metrics | None, note: str = "",
    ) -> int:
        row = (
            run_id, now, model.name, fingerprints.model, gpu.name, num_gpus, fingerprints.hardware, shape.name,
            shape_fingerprint(shape), json.dumps(shape.to_dict()), evaluator, proposer, json.dumps(config.to_dict()),
            config_key(config), "rejected" if metrics is None else "evaluated", json.dumps([list(g) for g in gates]),
            None if metrics is None else json.dumps(metrics.to_dict()), note,
        )
        insert = ("INSERT INTO trials (run_id, created_at, model, model_fp, gpu, num_gpus, hardware_fp, shape_name, shape_fp, "
                  "shape_json, evaluator, proposer, config_json, config_key, status, gates_json, metrics_json, note) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
        return self._transaction(lambda: int(self._db.execute(insert, row).lastrowid))  # type: ignore[arg-type]

    def record_artefact(
        self, run_id: str, now: float, model: ModelSpec, gpu: GpuSpec, num_gpus: int, fingerprints: Fingerprints,
        shape: TrafficShape, evaluator: str, objective: str, config: EngineConfig, metrics: Metrics, baseline: Metrics,
        num_trials: int, warm_start: bool, reason: str,
    ) -> int:
        row = (run_id, now, model.name, fingerprints.model, gpu.name, num_gpus, fingerprints.hardware, shape.name,
               shape_fingerprint(shape), evaluator, objective, json.dumps(config.to_dict()), json.dumps(metrics.to_dict()),
               json.dumps(baseline.to_dict()), num_trials, int(warm_start), reason, fingerprints.engine_version)
        insert = ("INSERT INTO artefacts (run_id, created_at, model, model_fp, gpu, num_gpus, hardware_fp, shape_name, "
                  "shape_fp, evaluator, objective, config_json, metrics_json, baseline_json, num_trials, warm_start, reason, "
                  "engine_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
        return self._transaction(lambda: int(self._db.execute(insert, row).lastrowid))  # type: ignore[arg-type]

    def record_probe_trial(
        self, run_id: str, now: float, model: ModelSpec, gpu: GpuSpec, shape: TrafficShape, measured_shape: TrafficShape,
        config: EngineConfig, predicted: Metrics, measured: Measurement, fingerprint: ProbeFingerprint, default: bool,
        chosen: bool,
    ) -> int:
        row = (run_id, now, model.name, model_fingerprint(model), gpu.name, shape.name, shape_fingerprint(shape),
               json.dumps(measured_shape.to_dict()), json.dumps(config.to_dict()), config_key(config),
               json.dumps(predicted.to_dict()), json.dumps(measured.to_dict()), json.dumps(fingerprint.to_dict()),
               fingerprint.digest(), int(default), int(chosen))
        insert = ("INSERT INTO probe_trials (run_id, created_at, model, model_fp, gpu, shape_name, shape_fp, measured_shape_json, "
                  "config_json, config_key, predicted_json, measured_json, fingerprint_json, fingerprint, is_default, chosen) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")

        def write() -> int:
            self._db.execute(_PROBE_SCHEMA)
            return int(self._db.execute(insert, row).lastrowid)  # type: ignore[arg-type]

        return self._transaction(write)

    def probe_trials(self, run_id: str | None = None) -> list[ProbeTrialRecord]:
        """Measured trials, oldest first (none in a store no probe has written to)."""
        if not self._has_table("probe_trials"):
            return []
        query, params = "SELECT * FROM probe_trials", list[object]()
        if run_id is not None:
            query, params = query + " WHERE run_id = ?", [run_id]
        return [_probe_trial(row) for row in self._read(query + " ORDER BY id", params)]

    def reusable_probe_trials(self, fingerprint: ProbeFingerprint, shape: TrafficShape, measured_shape: TrafficShape,
                              requests_per_step: int) -> list[ProbeTrialRecord]:
        """Measured trials a probe compile may reuse instead of measuring again, oldest first: same engine
        and version, hardware and weights (the fingerprint), same requested and measured shape, and
        ladder steps of the same number of requests."""
        if not self._has_table("probe_trials"):
            return []
        query = "SELECT * FROM probe_trials WHERE fingerprint = ? AND shape_fp = ? AND measured_shape_json = ? ORDER BY id"
        rows = self._read(query, [fingerprint.digest(), shape_fingerprint(shape), json.dumps(measured_shape.to_dict())])
        return [t for t in map(_probe_trial, rows) if all(s.num_requests == requests_per_step for s in t.measured.steps)]

    def record_probe_correction(self, correction: ProbeCorrection) -> int:
        insert = "INSERT INTO probe_corrections (fingerprint, model, correction_json) VALUES (?, ?, ?)"
        row = (correction.fingerprint, correction.model, json.dumps(correction.to_dict()))

        def write() -> int:
            self._db.execute(_CORRECTION_SCHEMA)
            return int(self._db.execute(insert, row).lastrowid)  # type: ignore[arg-type]

        return self._transaction(write)

    def probe_correction(self, fingerprint: str, model: str) -> ProbeCorrection | None:
        """The newest fitted correction for this fingerprint digest and model, None when none was fitted."""
        if not self._has_table("probe_corrections"):
            return None
        query = "SELECT correction_json FROM probe_corrections WHERE fingerprint = ? AND model = ? ORDER BY id DESC LIMIT 1"
        rows = self._read(query, [fingerprint, model])
        return ProbeCorrection(**json.loads(str(rows[0]["correction_json"]))) if rows else None

    def _has_table(self, name: str) -> bool:
        return bool(self._read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [name]))

    def assign_pools(self, artefact_id: int, pools: Sequence[str]) -> None:
        """Record which pools run a compiled artefact (the fleet calls this after a rollout)."""
        update = "UPDATE artefacts SET pools_json = ? WHERE id = ?"
        self._transaction(lambda: self._db.execute(update, (json.dumps(sorted(pools)), artefact_id)))

    def trials(self, model: str, gpu: str, num_gpus: int, evaluator: str | None = None, run_id: str | None = None) -> list[TrialRecord]:
        """Every trial of `model` on `num_gpus` x `gpu` (fresh and stale), oldest first."""
        query = "SELECT * FROM trials WHERE model = ? AND gpu = ? AND num_gpus = ?"
        params: list[object] = [model, gpu, num_gpus]
        if evaluator is not None:
            query, params = query + " AND evaluator = ?", [*params, evaluator]
        if run_id is not None:
            query, params = query + " AND run_id = ?", [*params, run_id]
        return [_trial(row) for row in self._read(query + " ORDER BY id", params)]

    def artefacts(self, model: str | None = None, gpu: str | None = None, limit: int = 20) -> list[ArtefactRecord]:
        """Compiled artefacts, newest first, optionally for one model and GPU kind."""
        query, params = "SELECT * FROM artefacts WHERE 1 = 1", list[object]()
        if model is not None:
            query, params = query + " AND model = ?", [*params, model]
        if gpu is not None:
            query, params = query + " AND gpu = ?", [*params, gpu]
        return [_artefact(row) for row in self._read(query + " ORDER BY id DESC LIMIT ?", [*params, limit])]

    def find_artefact(self, model: str, gpu: str, num_gpus: int, fingerprints: Fingerprints, shape_fp: str, evaluator: str,
                      objective: str) -> ArtefactRecord | None:
        """The newest compiled artefact for exactly this shape, whose model and hardware fingerprints
        still match (a stale one is not reused: its search must run again, seeded by it)."""
        query = ("SELECT * FROM artefacts WHERE model = ? AND gpu = ? AND num_gpus = ? AND model_fp = ? AND hardware_fp = ? "
                 "AND shape_fp = ? AND evaluator = ? AND objective = ? ORDER BY id DESC LIMIT 1")
        rows = self._read(query, [model, gpu, num_gpus, fingerprints.model, fingerprints.hardware, shape_fp, evaluator, objective])
        return _artefact(rows[0]) if rows else None

    def _read(self, query: str, params: Sequence[object]) -> list[dict[str, Any]]:  # sqlite3 columns are untyped
        try:
            cursor = self._db.execute(query, params)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row)) for row in cursor.fetchall()]
        except sqlite3.DatabaseError as exc:
            raise StoreError(_explain(self.path, exc)) from exc

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
            self._db = None  # type: ignore[assignment]

    def __enter__(self) -> TrialStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _trial(row: Mapping[str, Any]) -> TrialRecord:
    metrics = row["metrics_json"]
    return TrialRecord(
        trial_id=int(row["id"]), run_id=str(row["run_id"]), created_at=float(row["created_at"]),
        model=str(row["model"]), model_fp=str(row["model_fp"]), gpu=str(row["gpu"]), num_gpus=int(row["num_gpus"]),
        hardware_fp=str(row["hardware_fp"]), shape=TrafficShape.from_dict(json.loads(str(row["shape_json"]))),
        shape_fp=str(row["shape_fp"]), evaluator=str(row["evaluator"]), proposer=str(row["proposer"]),
        config=EngineConfig.from_dict(json.loads(str(row["config_json"]))), status=str(row["status"]),
        gates=tuple(tuple(g) for g in json.loads(str(row["gates_json"]))),
        metrics=None if metrics is None else Metrics.from_dict(json.loads(str(metrics))), note=str(row["note"]),
    )


def _probe_trial(row: Mapping[str, Any]) -> ProbeTrialRecord:
    fingerprint = {k: v for k, v in json.loads(str(row["fingerprint_json"])).items() if k != "digest"}
    return ProbeTrialRecord(
        trial_id=int(row["id"]), run_id=str(row["run_id"]), model=str(row["model"]), gpu=str(row["gpu"]),
        shape_name=str(row["shape_name"]), shape_fp=str(row["shape_fp"]),
        config=EngineConfig.from_dict(json.loads(str(row["config_json"]))),
        predicted=Metrics.from_dict(json.loads(str(row["predicted_json"]))),
        measured=Measurement.from_dict(json.loads(str(row["measured_json"]))),
        fingerprint=ProbeFingerprint(**fingerprint), default=bool(row["is_default"]), chosen=bool(row["chosen"]),
    )


def _artefact(row: Mapping[str, Any]) -> ArtefactRecord:
    return ArtefactRecord(
        artefact_id=int(row["id"]), run_id=str(row["run_id"]), created_at=float(row["created_at"]),
        model=str(row["model"]), gpu=str(row["gpu"]), num_gpus=int(row["num_gpus"]), shape_name=str(row["shape_name"]),
        shape_fp=str(row["shape_fp"]), evaluator=str(row["evaluator"]), objective=str(row["objective"]),
        config=EngineConfig.from_dict(json.loads(str(row["config_json"]))),
        metrics=Metrics.from_dict(json.loads(str(row["metrics_json"]))),
        baseline=Metrics.from_dict(json.loads(str(row["baseline_json"]))), num_trials=int(row["num_trials"]),
        warm_start=bool(row["warm_start"]), reason=str(row["reason"]), engine_version=str(row["engine_version"]),
        pools=tuple(json.loads(str(row["pools_json"]))),
    )


def _explain(path: Path, exc: sqlite3.Error) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return f"trial store {path} is locked by another process for too long ({text}); nothing was written"
    if "full" in text:
        return f"trial store {path} is full ({text}); nothing was written: free space or name another store"
    if "not a database" in text or "malformed" in text:
        return f"trial store {path} is not a readable SQLite trial store ({text}); move it aside or name another store (compile --store, simulate --compile-store, fleet.controller.compile_store)"
    return f"trial store {path}: {text}"
