"""PNG plots of a run (matplotlib, Agg backend): latency CDFs per tier, goodput and p99 TTFT over
time with drift onsets and fleet changes, and the traffic mix over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from loadtest.events import is_fleet_change  # noqa: E402
from loadtest.record import RequestRecord  # noqa: E402

PLOT_FILES = ("latency_cdf.png", "timeline.png", "traffic_mix.png")
_MAX_EVENT_LABELS = 12


def write_plots(out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord]) -> list[Path]:
    paths = [out_dir / name for name in PLOT_FILES]
    _latency_cdfs(paths[0], summary, records)
    _timeline(paths[1], summary)
    _traffic_mix(paths[2], summary)
    return paths


def _latency_cdfs(path: Path, summary: dict[str, Any], records: Sequence[RequestRecord]) -> None:
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end"))
    tiers = sorted({record.tier for record in records})
    for axis, (field, title) in zip(axes, metrics):
        for tier in tiers:
            values = np.sort([getattr(r, field) for r in records if r.ok and r.tier == tier and getattr(r, field) is not None])
            if values.size:
                line = axis.plot(values, np.arange(1, values.size + 1) / values.size, label=f"{tier} (n={values.size})")
                objective = summary["slo"].get(tier, {}).get(field)
                if objective is not None:
                    axis.axvline(objective, color=line[0].get_color(), linestyle="--", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_xlabel(f"{title} (s, log); dashed = tier objective")
        axis.set_ylabel("fraction of requests")
        axis.set_title(f"{title} CDF by tier")
        axis.grid(True, alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize=8)
    figure.suptitle(f"{summary['workload']}: latency CDFs")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _mark_events(axis: plt.Axes, summary: dict[str, Any], label: bool) -> None:
    for onset in summary.get("drift_onsets_s", []):
        axis.axvline(onset, color="red", linestyle="--", linewidth=1, label="drift onset" if label else None)
        label = False
    changes = [event for event in summary.get("gateway_events", []) if is_fleet_change(event["kind"])]
    for number, event in enumerate(changes):
        axis.axvline(event["at_s"], color="purple", linestyle=":", linewidth=1,
                     label="fleet change (decision log)" if number == 0 else None)
        if number < _MAX_EVENT_LABELS:
            axis.annotate(event["kind"], (event["at_s"], 1), xycoords=("data", "axes fraction"),
                          rotation=90, fontsize=6, va="top", color="purple")


def _timeline(path: Path, summary: dict[str, Any]) -> None:
    line = summary["timeline"]
    starts = np.array(line["start_s"]) + line["bin_s"] / 2
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    top.plot(starts, np.array(line["requests"]) / line["bin_s"], color="grey", label="offered (req/s)")
    top.plot(starts, line["goodput_rps"], color="green", label="goodput (req/s meeting tier SLOs)")
    top.set_ylabel("requests / s")
    top.set_title(f"{summary['workload']}: goodput and p99 TTFT over time")
    _mark_events(top, summary, label=True)
    top.legend(fontsize=8)
    top.grid(True, alpha=0.3)
    p99 = np.array([np.nan if value is None else value for value in line["p99_ttft_s"]], dtype=float)
    bottom.plot(starts, p99, color="blue", marker=".", label="p99 TTFT")
    if np.isfinite(p99).any() and np.nanmin(p99) > 0:
        bottom.set_yscale("log")
    bottom.set_ylabel("p99 TTFT (s)")
    bottom.set_xlabel(f"time since run start (s), bins of {line['bin_s']:.0f} s by scheduled arrival")
    _mark_events(bottom, summary, label=False)
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _traffic_mix(path: Path, summary: dict[str, Any]) -> None:
    line = summary["timeline"]
    figure, axis = plt.subplots(figsize=(12, 4.5))
    labels = list(line["label_counts"])
    if labels:
        rates = np.array([line["label_counts"][label] for label in labels], dtype=float) / line["bin_s"]
        axis.stackplot(np.array(line["start_s"]), rates, labels=[label or "(unlabelled)" for label in labels], step="post")
        axis.legend(fontsize=8, loc="upper left")
    _mark_events(axis, summary, label=not labels)
    axis.set_xlabel("time since run start (s)")
    axis.set_ylabel("offered requests / s")
    axis.set_title(f"{summary['workload']}: traffic mix over time (by workload class)")
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
