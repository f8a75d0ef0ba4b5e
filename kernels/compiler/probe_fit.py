"""Fit the performance model to measured trials: one goodput factor per fingerprint and model.

The probe stores the model's predicted goodput beside the measured one (probe_trials). On llama.cpp
on one CPU core the model over-predicts several-fold, by a similar factor for every configuration, so
the correction is one number per (engine and version, hardware, weights; model): the geometric mean of
measured / predicted goodput over the trials it is fitted on. It is fitted on a deterministic part of
the trials (in the order they were measured, every third from the second is held back) and its error
is reported on both parts, before and after, so a factor that only fits what it saw shows it.

A trial whose measured goodput is 0 (no rate of its ladder met the objectives) has no ratio: it is
counted as censored, not fitted. A fingerprint with a single usable trial gets a factor with no
held-back error (None)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from kernels.calibration import ScoredRow
from kernels.compiler.measurement import ProbeCorrection
from kernels.compiler.store import ProbeTrialRecord

_HOLD_BACK_EVERY = 3  # positions 1, 4, 7, ... of a fingerprint's usable trials are held back


def split(records: Sequence[ProbeTrialRecord]) -> tuple[list[ProbeTrialRecord], list[ProbeTrialRecord]]:
    """(fitted on, held back) in the order of the trials' ids."""
    ordered = sorted(records, key=lambda r: r.trial_id)
    held = [r for i, r in enumerate(ordered) if i % _HOLD_BACK_EVERY == 1]
    return [r for r in ordered if r not in held], held


def median_ape_pct(records: Sequence[ProbeTrialRecord], goodput_factor: float = 1.0) -> float | None:
    """Median absolute percentage error of predicted x `goodput_factor` against measured goodput."""
    if not records:
        return None
    return statistics.median(ScoredRow(str(r.trial_id), "goodput_rps", "goodput", r.measured.goodput_rps,
                                       r.predicted.goodput_rps * goodput_factor).ape_pct for r in records)


def fit_correction(records: Sequence[ProbeTrialRecord], fitted_at: float) -> ProbeCorrection | None:
    """The correction of one fingerprint and model's trials; None when none measured a goodput above 0."""
    if len({(r.fingerprint.digest(), r.model) for r in records}) > 1:
        raise ValueError("fit_correction takes the trials of one fingerprint and model; use fit_corrections")
    usable = [r for r in records if r.measured.goodput_rps > 0 and r.predicted.goodput_rps > 0]
    if not usable:
        return None
    fit, held = split(usable)
    factor = math.exp(statistics.fmean(math.log(r.measured.goodput_rps / r.predicted.goodput_rps) for r in fit))
    fit_before, fit_after = median_ape_pct(fit), median_ape_pct(fit, factor)
    assert fit_before is not None and fit_after is not None  # `fit` holds at least the first usable trial
    return ProbeCorrection(
        fingerprint=usable[0].fingerprint.digest(), model=usable[0].model, goodput_factor=factor, num_fit=len(fit),
        num_held_back=len(held), num_censored=len(records) - len(usable), fit_before_pct=fit_before,
        fit_after_pct=fit_after, held_back_before_pct=median_ape_pct(held), held_back_after_pct=median_ape_pct(held, factor),
        fitted_at=fitted_at,
    )


def fit_corrections(records: Sequence[ProbeTrialRecord], fitted_at: float) -> list[ProbeCorrection]:
    """One correction per fingerprint and model among `records` (those with a usable trial), in order of first trial."""
    groups: dict[tuple[str, str], list[ProbeTrialRecord]] = {}
    for record in sorted(records, key=lambda r: r.trial_id):
        groups.setdefault((record.fingerprint.digest(), record.model), []).append(record)
    fitted = (fit_correction(group, fitted_at) for group in groups.values())
    return [correction for correction in fitted if correction is not None]
