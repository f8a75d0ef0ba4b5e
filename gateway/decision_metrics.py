"""The fleet controller's decisions as Prometheus series, read from its decision log at each scrape: what
an operator alerts on (a rollback, a lost GPU's ``capacity`` decision, a decision log that stopped
writing), in ``polymorph serve``'s ``/metrics`` (the embedded controller) and ``polymorph controller``'s."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.decisions import DecisionLog


class DecisionMetrics(Collector):
    def __init__(self, log: DecisionLog) -> None:
        self._log = log

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("polymorph_fleet_decisions", "Decisions the fleet controller made since this process started, by "
                                        "kind (drift, plan, step, verify, rollback, capacity, recompile, canary, ...; each is a line of GET /admin/decisions).",
                                        labels=["kind"])
        for kind, count in sorted(dict(self._log.kind_to_count).items()):  # a copy: polymorph controller appends on its tick thread
            decisions.add_metric([kind], count)
        yield decisions
        yield GaugeMetricFamily("polymorph_decision_log_unwritten", "Decisions queued in memory while the decision log's file refuses writes.",
                                value=self._log.num_unwritten)
        yield CounterMetricFamily("polymorph_decision_log_dropped", "Decisions given up on because the decision log's file refused writes "
                                  "for too long.", value=self._log.num_dropped)
