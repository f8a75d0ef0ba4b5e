"""`polymorph bench compile --evaluate probe`: the compiled configuration against the engine's defaults,
both measured on the real engine, for every (engine, shape) cell.

A cell is one probe compile (probe.py: the model screens, the default and the best `budget - 1` are
measured, the best measured is chosen). Choosing the best of several noisy measurements flatters the
winner, so unless `confirm` is off the cell then measures the default and the chosen configuration
once more, one after the other, on a ladder starting at the lower of their goodputs. The cell adopts
the chosen configuration only when that side-by-side pair confirms it (more goodput than the
default's); otherwise it keeps the default, as a controller would, and its speed-up is 1.0x, with the
pair's own ratio beside it (`confirm_speedup`; the compile's pair is kept too). A chosen
configuration that is the default has nothing to confirm: 1.0x. The adopted configuration's prediction
error (predicted / measured goodput - 1) says how far the performance model was from the engine.

kernels starts no process: the prober is injected (the `polymorph` command supplies the real one)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernels.catalog import get_gpu, get_model
from kernels.compiler.measurement import Measurement, ProbeLadder
from kernels.compiler.probe import CPU_ENGINES, Prober, ProbeResult, ProbeTarget, ProbeTrial, probe_compile
from kernels.compiler.shape import get_shape, tier_shape
from kernels.compiler.store import StoreError, TrialStore

DEFAULT_SHAPES = ("short-chat", "long-context")
DEFAULT_BUDGET = 4
TARGET_SPEEDUP = 1.3  # the bar: at least this on one shape, never below the default


@dataclass(frozen=True, slots=True)
class ProbeCell:
    engine: str
    shape: str
    compile: ProbeResult
    confirm_default: Measurement | None  # None: not confirmed (the default was chosen, or --no-confirm)
    confirm_chosen: Measurement | None

    @property
    def chose_default(self) -> bool:
        return self.compile.chosen.default

    @property
    def rejected(self) -> bool:
        """Measured again beside the default, the compile's choice did not beat it: the default stays."""
        if self.confirm_chosen is None or self.confirm_default is None:
            return False
        return self.confirm_chosen.goodput_rps <= self.confirm_default.goodput_rps

    @property
    def adopted(self) -> ProbeTrial:
        return self.compile.baseline if self.chose_default or self.rejected else self.compile.chosen

    @property
    def default_goodput_rps(self) -> float:
        return (self.confirm_default or self.compile.baseline.measured).goodput_rps

    @property
    def chosen_goodput_rps(self) -> float:
        """The adopted configuration's goodput."""
        if self.adopted.default:
            return self.default_goodput_rps
        return (self.confirm_chosen or self.compile.chosen.measured).goodput_rps

    @property
    def speedup(self) -> float | None:
        """Adopted over default, measured side by side; None when neither sustained the lowest rate tried
        (or only the chosen did: the ratio is then unbounded, `default_below_rps` says below what)."""
        if self.adopted.default:
            return 1.0
        return self.chosen_goodput_rps / self.default_goodput_rps if self.default_goodput_rps > 0 else None

    @property
    def confirm_speedup(self) -> float | None:
        """The confirmation pair's own ratio, the compile's choice over the default (None: not confirmed)."""
        if self.confirm_chosen is None or self.confirm_default is None:
            return None
        return _ratio(self.confirm_chosen.goodput_rps, self.confirm_default.goodput_rps)

    @property
    def default_below_rps(self) -> float | None:
        """The lowest rate the default was measured at when it met none: its goodput is below this."""
        measured = self.confirm_default or self.compile.baseline.measured
        return None if measured.goodput_rps > 0 else min(step.rate_rps for step in measured.steps)

    @property
    def speedup_at_least(self) -> float | None:
        """The speed-up, or, when the default met no rate, the chosen one's ratio to the lowest rate tried."""
        return self.speedup if self.speedup is not None else _ratio(self.chosen_goodput_rps, self.default_below_rps or 0.0)

    @property
    def compile_speedup(self) -> float | None:
        """The compile's own pair (each the best of its ladder, not side by side)."""
        return _ratio(self.compile.chosen.measured.goodput_rps, self.compile.baseline.measured.goodput_rps)

    @property
    def elapsed_s(self) -> float:
        """The compile and the confirmation."""
        return self.compile.elapsed_s + sum(m.wall_s for m in (self.confirm_default, self.confirm_chosen) if m is not None)

    @property
    def prediction_error(self) -> float | None:
        """The adopted configuration's predicted / measured goodput - 1 (None: it met no rate)."""
        measured = self.chosen_goodput_rps
        return self.adopted.predicted.goodput_rps / measured - 1.0 if measured > 0 else None

    def to_json(self) -> dict[str, object]:
        adopted = self.adopted
        return {
            "engine": self.engine, "shape": self.shape, "chosen_args": list(adopted.engine_args),
            "chose_default": self.chose_default, "compile_chosen_args": list(self.compile.chosen.engine_args),
            "default_goodput_rps": self.default_goodput_rps, "chosen_goodput_rps": self.chosen_goodput_rps,
            "speedup": self.speedup, "speedup_at_least": self.speedup_at_least, "default_below_rps": self.default_below_rps,
            "compile_speedup": self.compile_speedup,
            "confirmed": self.confirm_chosen is not None, "rejected_on_confirmation": self.rejected, "confirm_speedup": self.confirm_speedup,
            "chosen_predicted_goodput_rps": adopted.predicted.goodput_rps, "chosen_prediction_error": self.prediction_error,
            "measured": len(self.compile.trials) - self.compile.num_reused, "screened": self.compile.num_screened,
            "elapsed_s": self.elapsed_s, "fingerprint": self.compile.fingerprint.to_dict(),
            "run_id": self.compile.run_id,
        }


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def run_probe_cell(engine: str, shape_name: str, model: str, budget: int, requests_per_step: int, prober: Prober,
                   store: TrialStore | None, confirm: bool, progress: Callable[[str], None], tier: str = "interactive") -> ProbeCell:
    result = probe_compile(get_model(model), get_gpu("cpu"), tier_shape(shape_name, tier), budget, prober, requests_per_step, store,
                           progress=progress, engine=engine)
    return confirmed(engine, shape_name, result, prober, progress) if confirm else ProbeCell(engine, shape_name, result, None, None)


def confirmed(engine: str, shape_name: str, result: ProbeResult, prober: Prober, progress: Callable[[str], None]) -> ProbeCell:
    """The cell with the default and the chosen configuration measured once more, one after the other,
    on the same ladder (equal rates replay equal requests), from the lower of their goodputs."""
    if result.chosen.default:
        return ProbeCell(engine, shape_name, result, None, None)
    base, chosen = result.baseline.measured, result.chosen.measured
    passed = [rate for rate in (base.goodput_rps, chosen.goodput_rps) if rate > 0]
    start_rps = min(passed) if passed else min(step.rate_rps for step in base.steps)
    ladder = ProbeLadder(start_rps=start_rps, requests_per_step=result.ladder.requests_per_step)
    progress(f"confirming side by side from {start_rps:.3g} req/s: the default, then the chosen")
    again_default = prober.measure(result.baseline.config, result.shape, ladder)
    again_chosen = prober.measure(result.chosen.config, result.shape, ladder)
    progress(f"confirmed: default {again_default.goodput_rps:.3g} req/s, chosen {again_chosen.goodput_rps:.3g} req/s")
    return ProbeCell(engine, shape_name, result, again_default, again_chosen)


def summarize(cells: list[ProbeCell]) -> dict[str, object]:
    """The bench's last line: per cell and the issue's two checks, >= 1.3x on one shape, and never worse
    than the default (what the adoption rule keeps: `min_speedup`; `cells_rejected_on_confirmation` says
    how often the compile's pick lost its confirmation, and `worst_confirm_speedup` by how much)."""
    speedups = [c.speedup for c in cells]
    lower_bounds = [c.speedup_at_least for c in cells]
    confirms = [c.confirm_speedup for c in cells if c.confirm_speedup is not None]
    return {
        "evaluator": "probe", "cells": len(cells),
        "best_speedup": max((s for s in lower_bounds if s is not None), default=None),
        "min_speedup": min((s for s in speedups if s is not None), default=None),
        "cells_at_target": sum(1 for s in lower_bounds if s is not None and s >= TARGET_SPEEDUP),
        "target_speedup": TARGET_SPEEDUP,
        "cells_rejected_on_confirmation": sum(1 for c in cells if c.rejected),
        "worst_confirm_speedup": min(confirms, default=None),
        "per_cell": [c.to_json() for c in cells],
    }


def main_probe_bench(args: argparse.Namespace, prober: Callable[[ProbeTarget], Prober] | None) -> int:
    if prober is None:
        raise SystemExit("polymorph bench compile: --evaluate probe needs the load tester's prober (run it as `polymorph bench`)")
    engines, shapes = args.engines or list(CPU_ENGINES), args.shapes or list(DEFAULT_SHAPES)
    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    unknown = [e for e in engines if e not in CPU_ENGINES]
    if unknown:
        raise SystemExit(f"polymorph bench compile: --evaluate probe measures on {' and '.join(CPU_ENGINES)}, not {unknown}")
    try:
        for shape in shapes:
            get_shape(shape)
        get_model(args.model)
    except ValueError as exc:
        raise SystemExit(f"polymorph bench compile: {exc}") from exc

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    print(f"{'engine':<10}{'shape':<14}{'default':>9}{'chosen':>9}{'x':>7}{'compile x':>10}{'pred err':>10}{'s':>6}  chosen flags",
          flush=True)
    cells: list[ProbeCell] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            store = TrialStore(args.store or Path(tmp) / "probe-bench.sqlite3")
        except StoreError as exc:
            raise SystemExit(f"polymorph bench compile: {exc}") from exc
        with store:
            for engine in engines:
                for shape in shapes:
                    progress(f"== {engine} / {shape}: budget {budget}, {args.probe_requests} requests a step")
                    try:
                        cell = run_probe_cell(engine, shape, args.model, budget, args.probe_requests, prober(ProbeTarget(engine)), store,
                                              not args.no_confirm, progress, args.tier)
                    except (RuntimeError, StoreError) as exc:
                        raise SystemExit(f"polymorph bench compile: {engine} / {shape}: {exc}") from exc
                    cells.append(cell)
                    print(_row(cell), flush=True)
    print(json.dumps(summarize(cells)))
    return 0


def _row(cell: ProbeCell) -> str:
    def figure(value: float | None, suffix: str = "") -> str:
        return "-" if value is None else f"{value:.0f}{suffix}" if abs(value) >= 1000 else f"{value:.3g}{suffix}"

    at_least = cell.speedup_at_least
    speedup = figure(at_least) if cell.speedup is not None or at_least is None else f">{figure(at_least)}"
    error = cell.prediction_error
    flags = " ".join(cell.adopted.engine_args) or "(defaults)"
    if cell.rejected:
        flags += f"  (the compile's {' '.join(cell.compile.chosen.engine_args)} measured {figure(cell.confirm_speedup)}x beside it: kept the default)"
    return (f"{cell.engine:<10}{cell.shape:<14}{cell.default_goodput_rps:>9.3g}{cell.chosen_goodput_rps:>9.3g}{speedup:>7}"
            f"{figure(cell.compile_speedup):>10}{figure(None if error is None else 100 * error, '%'):>10}"
            f"{cell.elapsed_s:>6.0f}  {flags}")
