import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, StoreError, TrialStore, compile_config
from kernels.compiler.evaluators import AnalyticEvaluator, Metrics
from kernels.compiler.shape import get_shape
from kernels.compiler.store import Fingerprints, fingerprints_for
from kernels.config import EngineConfig

MODEL, GPU, SHAPE = get_model("llama-3.1-8b"), get_gpu("H100"), get_shape("reasoning")
FPS = Fingerprints("model-fp", "hw-fp")
METRICS = Metrics(2.0, 2.0, 100.0, 0.5, 0.02, 0.3, 0.4, "memory-bound")


def _write_trials(path: str, writer: int, count: int) -> None:
    with TrialStore(path) as store:
        for index in range(count):
            config = EngineConfig(max_running_requests=writer * 1000 + index + 1)
            store.record_trial(f"run-{writer}", float(index), MODEL, GPU, 1, FPS, SHAPE, "analytic", "test", config,
                               [("constraints", "passed", "")], METRICS)


def test_store_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "trials.sqlite3"
    _write_trials(str(path), 0, 3)
    with TrialStore(path) as store:
        store.record_trial("run-x", 9.0, MODEL, GPU, 1, FPS, SHAPE, "analytic", "test", EngineConfig(tp=1),
                           [("memory", "rejected", "too big")], None, note="why")
    with TrialStore(path) as reopened:
        trials = reopened.trials(MODEL.name, GPU.name, 1)
    assert [t.config.max_running_requests for t in trials] == [1, 2, 3, None]
    assert trials[0].metrics == METRICS and trials[0].shape == SHAPE
    assert (trials[-1].status, trials[-1].gates, trials[-1].note) == ("rejected", (("memory", "rejected", "too big"),), "why")


def test_two_processes_write_concurrently_without_losing_a_trial(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.sqlite3")
    TrialStore(path).close()
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_trials, args=(path, writer, 40)) for writer in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(60)
        assert process.exitcode == 0
    with TrialStore(path) as store:
        trials = store.trials(MODEL.name, GPU.name, 1)
    assert len(trials) == 80 and len({t.config.max_running_requests for t in trials}) == 80
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_corrupt_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="not a readable SQLite trial store"):
        TrialStore(path)


def test_a_locked_store_is_a_clear_error_not_a_silent_loss(tmp_path: Path) -> None:
    path = tmp_path / "locked.sqlite3"
    TrialStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with TrialStore(path, busy_timeout_s=0.2) as store, pytest.raises(StoreError, match="locked"):
            store.record_trial("r", 0.0, MODEL, GPU, 1, FPS, SHAPE, "analytic", "test", EngineConfig(), [], METRICS)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with TrialStore(path) as store:
        assert store.trials(MODEL.name, GPU.name, 1) == []


def test_stale_fingerprints_seed_the_search_but_are_evaluated_again(tmp_path: Path) -> None:
    evaluator = AnalyticEvaluator()
    with TrialStore(tmp_path / "t.sqlite3") as store:
        first = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=evaluator, engine_version="0.5.1")
        again = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=evaluator, engine_version="0.5.1")
        upgraded = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=evaluator, engine_version="0.5.2",
                                  budget=Budget(warm_patience_rounds=1))
    assert first is not None and again is not None and upgraded is not None
    # Same fingerprints: every trial is reused from the store, nothing is evaluated again.
    assert again.trials == 0 and all(t.reused for t in again.history if t.metrics is not None)
    assert again.config == first.config
    # New engine version: the old winner seeds the search (warm) but is evaluated, not trusted.
    assert upgraded.warm_start and not any(t.reused for t in upgraded.history)
    seeds = [t for t in upgraded.history if t.proposer == "store-seed"]
    assert first.config in [t.config for t in seeds] and all(t.metrics is not None for t in seeds)
    assert upgraded.trials < first.trials


class _RevisedAnalytic(AnalyticEvaluator):
    """The analytic evaluator after a change that scores configurations differently."""

    version = AnalyticEvaluator.version + 1


def test_a_new_evaluator_version_makes_stored_trials_and_artefacts_stale(tmp_path: Path) -> None:
    with TrialStore(tmp_path / "v.sqlite3") as store:
        first = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=AnalyticEvaluator())
        revised = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=_RevisedAnalytic(), budget=Budget(warm_patience_rounds=1))
        shape_fp = store.artefacts(MODEL.name, GPU.name)[0].shape_fp
        found = {version: store.find_artefact(MODEL.name, GPU.name, 1, fingerprints_for(MODEL, GPU, 1, "unknown", version),
                                              shape_fp, "analytic", "goodput") for version in (1, 2)}
    assert first is not None and revised is not None
    # the old version's trials seed the search but none is trusted: each is evaluated again
    assert revised.warm_start and not any(t.reused for t in revised.history)
    assert first.config in [t.config for t in revised.history if t.proposer == "store-seed"]
    # each version finds only its own artefact
    assert found[1] is not None and found[1].run_id == first.run_id
    assert found[2] is not None and found[2].run_id == revised.run_id


def test_artefacts_record_versions_and_pools(tmp_path: Path) -> None:
    with TrialStore(tmp_path / "a.sqlite3") as store:
        result = compile_config(MODEL, GPU, 1, SHAPE, store=store, evaluator=AnalyticEvaluator(), engine_version="0.5.2")
        (artefact,) = store.artefacts(MODEL.name, GPU.name)
        store.assign_pools(artefact.artefact_id, ["long-h200", "chat-h100"])
        (updated,) = store.artefacts()
    assert result is not None and artefact.config == result.config and artefact.num_trials == result.trials
    assert artefact.engine_version == "0.5.2" and artefact.reason == result.reason
    assert updated.pools == ("chat-h100", "long-h200")
