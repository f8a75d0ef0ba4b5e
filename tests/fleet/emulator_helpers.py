"""Talk to emulator subprocesses with the standard library (they start via tests.support.procs)."""

from __future__ import annotations

import http.client
import json
from typing import Any


def request(base: str, method: str, path: str, body: object = None, timeout_s: float = 30.0) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post_json(base: str, path: str, body: object) -> tuple[int, Any]:
    status, raw = request(base, "POST", path, body)
    return status, json.loads(raw) if raw else None


def get_json(base: str, path: str) -> Any:
    status, raw = request(base, "GET", path)
    assert status == 200, raw
    return json.loads(raw)


def chat_body(content: str, max_tokens: int, stream: bool = False, **extra: object) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, **extra}


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line (labels dropped: one model per emulator)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, value = line.rsplit(" ", 1)
        name = name_and_labels.split("{", 1)[0]
        if "_bucket" in name:
            continue
        samples[name] = float(value)
    return samples
