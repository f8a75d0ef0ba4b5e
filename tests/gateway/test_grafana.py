"""The Grafana dashboard only queries what a real gateway exports: every metric and label each panel,
variable and annotation names appears on the /metrics of a gateway that has served traffic, retried,
ejected a replica, refused a request and reloaded its config.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import REPO, free_port
from tests.support.procs import running, start_emulator, start_gateway, write_tenant

DASHBOARD = REPO / "deploy" / "grafana" / "polymorph.json"
KEY, ADMIN = "sk-grafana-test", "admin-token-grafana"
_METRIC = re.compile(r"\bpolymorph_[a-z0-9_]+\b")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_LABEL_VALUES = re.compile(r"label_values\(\s*(polymorph_[a-z0-9_]+)\s*,\s*([a-z_]+)\s*\)")
_SAMPLE = re.compile(r"^(polymorph_[a-z0-9_]+)(?:\{([^}]*)\})? ")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, variable and annotation."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    found += [(f"variable {v['name']!r}", v["query"]["query"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


def _exported(metrics_text: str) -> dict[str, set[str]]:
    """Sample name -> label names seen, from the exposition text."""
    exported: dict[str, set[str]] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = {pair.split("=", 1)[0] for pair in (match.group(2) or "").split(",") if pair}
            exported.setdefault(match.group(1), set()).update(labels)
    return exported


def _call(url: str, body: dict[str, Any] | None = None, key: str = KEY) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        err.read()
        err.close()
        return err.code


def _scrape_busy_gateway(tmp: Path) -> str:
    emulator = start_emulator(tmp, "emulator", speed=50.0)
    tenants = tmp / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", KEY)
    config_path = tmp / "gateway.yaml"
    dead = f"http://127.0.0.1:{free_port()}"
    config = {
        "server": {"host": "127.0.0.1", "admin_token": ADMIN},
        "upstream": {"max_attempts": 2, "eject_after_failures": 1, "eject_cooldown_s": 60, "connect_timeout_s": 0.5},
        "tenants_dir": "tenants",
        # The dead replica fails its first request: a retry, an ejection and a replica_healthy sample.
        "fleet": {"pools": [{"name": "main", "model": "llama-3.1-8b", "shapes": ["short-chat", "long-context", "reasoning", "batch"], "replicas": {"urls": [dead, emulator.url]}}]},
    }
    config_path.write_text(json.dumps(config))
    gateway = start_gateway(tmp, ["--config", str(config_path)])
    with running(gateway, emulator):
        url = gateway.url + "/v1/chat/completions"
        for stream in (False, True, False, True):
            body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 8, "stream": stream}
            assert _call(url, body) == 200
        assert _call(url, {"model": "llama-3.1-8b", "messages": []}, key="sk-wrong") == 401  # a rejection
        gateway.process.send_signal(signal.SIGHUP)  # a config reload
        deadline = time.monotonic() + 15
        while True:
            with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
                text = response.read().decode()
            if "polymorph_config_reloads_total{" in text and "polymorph_tpot_seconds_count{" in text or time.monotonic() > deadline:
                return text
            time.sleep(0.2)


def test_every_query_names_metrics_and_labels_the_gateway_exports(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "polymorph-gateway" and dashboard["panels"]
    exported = _exported(_scrape_busy_gateway(tmp_path))
    queries = _queries(dashboard)
    assert len(queries) >= 25
    problems = []
    for where, expr in queries:
        metrics = set(_METRIC.findall(expr))
        if not metrics:
            problems.append(f"{where}: names no polymorph metric: {expr}")
        labels_available = {"le"} | {label for metric in metrics for label in exported.get(metric, set())}
        for metric in sorted(metrics - set(exported)):
            problems.append(f"{where}: {metric} is not on the gateway's /metrics")
        used = {label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip()}
        used |= set(_MATCHER.findall(expr))
        used |= {label for _, label in _LABEL_VALUES.findall(expr)}
        for label in sorted(used - labels_available):
            problems.append(f"{where}: label {label!r} is not on {sorted(metrics)}")
    assert not problems, "\n".join(problems)


def test_every_panel_has_a_query_a_datasource_and_a_place() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = []
    for panel in _panels(dashboard["panels"]):
        ids.append(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel.get("description"), panel["title"]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "pool", "tier"}
