"""Control-loop events from the gateway's decision log, placed on the run's timeline.

``GET /admin/decisions`` (with the admin token) may answer a JSON list, ``{"decisions": [...]}``
or JSONL. Each entry's time (unix seconds under ``at``/``ts``/``time``/``timestamp``/``at_unix_s``)
becomes seconds from the run start. A gateway without the endpoint (404), a refused token or an
unreachable gateway simply yields no events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson

_TIME_KEYS = ("at_unix_s", "at", "ts", "time", "timestamp", "created_at")
_KIND_KEYS = ("kind", "type", "action", "event", "step")
_MAX_EVENTS = 500


async def fetch_gateway_events(
    session: aiohttp.ClientSession, base_url: str, admin_token: str | None, started_at_unix_s: float
) -> tuple[dict[str, Any], ...]:
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        async with session.get(
            f"{base_url}/admin/decisions", headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as response:
            if response.status != 200:
                return ()
            raw = await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return ()
    return tuple(place_events(parse_decisions(raw), started_at_unix_s))


def parse_decisions(raw: bytes) -> list[dict[str, Any]]:
    """The entries of a decision-log answer in any of the accepted shapes ([] if none parse)."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        document = None
        entries = []
        for line in raw.splitlines():
            try:
                entries.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    if isinstance(document, dict):
        entries = document.get("decisions") or document.get("events") or document.get("data") or []
    elif isinstance(document, list):
        entries = document
    return [entry for entry in entries if isinstance(entry, dict)]


def place_events(entries: Iterable[dict[str, Any]], started_at_unix_s: float) -> list[dict[str, Any]]:
    """``{"at_s", "kind", "detail"}`` per entry that has a time; at_s is seconds from the run start."""
    placed: list[dict[str, Any]] = []
    for entry in entries:
        at_unix_s = next((entry[key] for key in _TIME_KEYS if isinstance(entry.get(key), (int, float))), None)
        if at_unix_s is None:
            continue
        kind = next((str(entry[key]) for key in _KIND_KEYS if entry.get(key)), "decision")
        detail = {key: value for key, value in entry.items() if key not in _TIME_KEYS and key not in _KIND_KEYS}
        placed.append({"at_s": float(at_unix_s) - started_at_unix_s, "kind": kind, "detail": detail})
    return placed[-_MAX_EVENTS:]


def is_fleet_change(kind: str) -> bool:
    """Repartitions and recompiles: the events the plots mark."""
    return any(word in kind.lower() for word in ("repartition", "recompile", "rollout", "compile", "plan"))
