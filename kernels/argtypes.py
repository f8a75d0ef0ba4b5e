"""argparse types for numbers that have a floor (a count of at least one, a positive or non-negative
amount, a fraction) and for URLs. Every command's flags use them, so a zero, a negative, a NaN or an
``ftp://`` target is refused by argparse as ``argument --rate: must be > 0, got '0'`` with exit 2
before anything runs, rather than ending in a traceback, a hang or a silent default deep inside a run."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit


def count(text: str) -> int:
    """An integer >= 1 (requests, rounds, workers, GPUs, trials)."""
    return _integer(text, 1)


def count_or_zero(text: str) -> int:
    """An integer >= 0 (a warm-up of none)."""
    return _integer(text, 0)


def positive(text: str) -> float:
    """A finite number > 0 (a rate, a duration, a speed)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (a delay, an offset; 0: none)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed, an integer >= 0: numpy's generators refuse a negative one (before, a traceback)."""
    return _integer(text, 0)


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port). Before, ``--port 70000`` wrapped round to 4464 in
    getaddrinfo and the server said it listened on 70000."""
    value = _integer(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text!r}")
    return value


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def counts(text: str) -> tuple[int, ...]:
    """Comma-separated integers, each >= 1 (``16,64,128``)."""
    return tuple(count(part) for part in _parts(text))


def positives(text: str) -> tuple[float, ...]:
    """Comma-separated numbers, each > 0 (``500,1000``)."""
    return tuple(positive(part) for part in _parts(text))


def _parts(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
    return parts


def is_http_url(text: str) -> bool:
    """An http:// or https:// URL with a host and no whitespace: what aiohttp can send a request to.
    The gateway config's replica and controller URLs are checked with it too."""
    try:
        parts = urlsplit(text)
        _port = parts.port  # a port that is not a number raises here, not at the first request
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in text)


def http_url(text: str) -> str:
    """A base URL (``http://127.0.0.1:8080``), without its trailing slash."""
    if not is_http_url(text):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, got {text!r}")
    return text.rstrip("/")
