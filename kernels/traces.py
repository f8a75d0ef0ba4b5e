"""Trace readers: Azure 2023/2024 CSV, BurstGPT CSV, Mooncake JSONL and Polymorph's native JSONL.

One reader for every package: ``polymorph compile --trace`` (kernels.compiler.trace_shape) summarises
the rows as a traffic shape, the load generator (loadtest.traces) replays them. Rows that cannot be
used are skipped and reported as ``RowIssue(line, reason)``; a file that is not the named format at
all (wrong header, not JSON, ...) raises ``TraceFormatError`` that names the format and what is wrong.
Reads files only.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

FORMATS: tuple[str, ...] = ("azure", "burstgpt", "mooncake", "native")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_NATIVE_KEYS = ("timestamp", "input_length", "output_length")
_MAX_BAD_FRACTION = 0.5  # more bad rows than this and the file is probably another format


class TraceFormatError(ValueError):
    """The file is not a trace of the named format."""


class _BadRow(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RowIssue:
    """A trace row that was skipped: where it is and why."""

    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace, as the trace states it (None: the trace does not say)."""

    arrival_s: float  # on the trace's own clock; readers shift the first request to 0
    input_tokens: int
    output_tokens: int
    domain: str | None = None
    tenant: str | None = None
    tier: str | None = None
    hash_ids: tuple[int, ...] = ()  # equal leading ids = a shared prompt prefix (Mooncake: 512-token blocks)
    text: str | None = None
    label: str = ""  # BurstGPT's model column


@dataclass(frozen=True, slots=True)
class Trace:
    rows: tuple[TraceRow, ...]  # in file order, at least one
    issues: tuple[RowIssue, ...]
    label: str  # the file's name without its suffixes (conv.csv.gz is conv)


def report_skipped_rows(path: Path | str, issues: Sequence[RowIssue], out: TextIO | None = None) -> None:
    """Tell the user, on stderr, which rows of ``path`` a command skipped (the first ten of them): a trace
    read with some rows dropped must not pass for the whole file."""
    if not issues:
        return
    out = out if out is not None else sys.stderr
    print(f"warning: {path}: skipped {len(issues)} bad row{'' if len(issues) == 1 else 's'}:", file=out)
    for issue in issues[:10]:
        print(f"  line {issue.line}: {issue.reason}", file=out)
    if len(issues) > 10:
        print(f"  ... and {len(issues) - 10} more", file=out)


def _read_text(path: Path) -> str:
    """The trace's text; ``.gz`` files are decompressed (public traces ship that way).

    utf-8-sig: a spreadsheet's CSV export starts with a byte-order mark, which must not become part
    of the first column's name.
    """
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8-sig") as handle:
            return handle.read()
    return path.read_text(encoding="utf-8-sig")


def read_trace_rows(path: Path | str, trace_format: str) -> Trace:
    """Read ``path`` as ``trace_format`` (one of FORMATS): its usable rows and the skipped ones."""
    path = Path(path)
    if trace_format not in FORMATS:
        raise TraceFormatError(f"unknown trace format {trace_format!r}; choose one of {', '.join(FORMATS)}")
    try:
        text = _read_text(path)
    except (OSError, EOFError) as exc:  # gzip's errors are OSErrors, a truncated one an EOFError
        raise TraceFormatError(f"cannot read trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path} is not a text file (not UTF-8); expected {trace_format}") from None
    rows, issues = _PARSERS[trace_format](text, str(path))
    num_rows = len(rows) + len(issues)
    if num_rows and len(issues) > _MAX_BAD_FRACTION * num_rows and len(issues) > 2:
        first = issues[0]
        raise TraceFormatError(
            f"{path}: {len(issues)} of {num_rows} rows are not valid {trace_format} rows "
            f"(line {first.line}: {first.reason}); {_guess_hint(text, trace_format)}"
        )
    if not rows:
        raise TraceFormatError(f"{path}: no usable {trace_format} rows")
    label = Path(path.stem).stem if path.suffix == ".gz" else path.stem  # conv.csv.gz is conv, as conv.csv
    return Trace(tuple(rows), tuple(issues), label)


def sniff_format(text: str) -> str | None:
    """The format the start of ``text`` looks like, or None."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            obj = json.loads(first)
        except ValueError:
            return None
        if isinstance(obj, dict) and "hash_ids" in obj and isinstance(obj.get("timestamp"), int):
            return "mooncake"
        return "native" if isinstance(obj, dict) else None
    header = [cell.strip() for cell in next(csv.reader([first]), [])]
    if all(column in header for column in _AZURE_COLUMNS):
        return "azure"
    if all(column in header for column in _BURSTGPT_COLUMNS):
        return "burstgpt"
    return None


def _guess_hint(text: str, expected: str) -> str:
    guess = sniff_format(text)
    if guess and guess != expected:
        return f"it looks like {guess} (try --format {guess})"
    return f"formats: {', '.join(FORMATS)} (see loadtest/README.md)"


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    try:
        number = int(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _BadRow(f"{name} is not a number: {value!r}") from None
    if number < minimum or number != float(value):  # type: ignore[arg-type]
        raise _BadRow(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _finite_time(value: object, name: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _BadRow(f"{name} is not a number: {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")) or number < 0:
        raise _BadRow(f"{name} must be a finite time >= 0, got {value!r}")
    return number


Parsed = tuple[list[TraceRow], list[RowIssue]]


def _csv_rows(text: str, source: str, columns: tuple[str, ...], fmt: str) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = [name.strip() for name in (reader.fieldnames or [])]
    missing = [column for column in columns if column not in header]
    if missing:
        raise TraceFormatError(
            f"{source} is not {fmt} CSV: header {header or '(empty)'} lacks {', '.join(missing)}; "
            f"{_guess_hint(text, fmt)}"
        )
    reader.fieldnames = header
    for row in reader:
        yield reader.line_num, row


def _parse_csv(
    text: str, source: str, columns: tuple[str, ...], fmt: str, build: Callable[[dict[str, str]], TraceRow]
) -> Parsed:
    specs: list[TraceRow] = []
    issues: list[RowIssue] = []
    for line, row in _csv_rows(text, source, columns, fmt):
        if None in row or any(row.get(column) in (None, "") for column in columns):
            issues.append(RowIssue(line, f"expected columns {', '.join(columns)}; row has missing or extra cells"))
            continue
        try:
            specs.append(build(row))
        except _BadRow as exc:
            issues.append(RowIssue(line, str(exc)))
    return specs, issues


def _azure_time(value: str) -> float:
    # Azure's 2023 trace writes 7 fractional digits (Python >= 3.11 parses them, keeping microseconds),
    # its 2024 trace a UTC offset; a stamp without one is UTC, so the local zone's daylight-saving
    # jumps never enter the gaps between requests.
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise _BadRow(f"TIMESTAMP is not a 'YYYY-MM-DD HH:MM:SS.fffffff' time: {value!r}") from None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).timestamp()


def parse_azure(text: str, source: str) -> Parsed:
    def build(row: dict[str, str]) -> TraceRow:
        return TraceRow(
            arrival_s=_azure_time(row["TIMESTAMP"]),
            input_tokens=_positive_int(row["ContextTokens"], "ContextTokens"),
            output_tokens=_positive_int(row["GeneratedTokens"], "GeneratedTokens"),
        )

    return _parse_csv(text, source, _AZURE_COLUMNS, "azure", build)


def parse_burstgpt(text: str, source: str) -> Parsed:
    """BurstGPT rows with 0 response tokens are failed requests upstream: reported and skipped."""

    def build(row: dict[str, str]) -> TraceRow:
        if row["Response tokens"].strip() in ("0", "0.0"):
            raise _BadRow("Response tokens is 0 (a failed request in BurstGPT)")
        model = (row.get("Model") or "").strip()
        return TraceRow(
            arrival_s=_finite_time(row["Timestamp"], "Timestamp"),
            input_tokens=_positive_int(row["Request tokens"], "Request tokens"),
            output_tokens=_positive_int(row["Response tokens"], "Response tokens"),
            label=model,
        )

    return _parse_csv(text, source, _BURSTGPT_COLUMNS, "burstgpt", build)


def _json_lines(text: str, source: str, fmt: str) -> Iterator[tuple[int, dict[str, object] | str]]:
    """(line, object) per non-blank line, or (line, reason) when the line is not a JSON object."""
    seen_object = False
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            if not seen_object and line <= 1:
                raise TraceFormatError(
                    f"{source} is not {fmt} JSONL: line 1 is not a JSON object; {_guess_hint(text, fmt)}"
                ) from None
            yield line, "not valid JSON"
            continue
        if not isinstance(obj, dict):
            yield line, "not a JSON object"
            continue
        seen_object = True
        yield line, obj


def _hash_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise _BadRow(f"hash_ids must be a list of integers, got {value!r}")
    return tuple(value)


def _parse_jsonl(
    text: str, source: str, fmt: str, keys: tuple[str, ...], build: Callable[[dict[str, object]], TraceRow]
) -> Parsed:
    specs: list[TraceRow] = []
    issues: list[RowIssue] = []
    for line, obj in _json_lines(text, source, fmt):
        if isinstance(obj, str):
            issues.append(RowIssue(line, obj))
            continue
        missing = [key for key in keys if key not in obj]
        if missing:
            issues.append(RowIssue(line, f"missing {', '.join(missing)}"))
            continue
        try:
            specs.append(build(obj))
        except _BadRow as exc:
            issues.append(RowIssue(line, str(exc)))
    return specs, issues


def parse_mooncake(text: str, source: str) -> Parsed:
    """Mooncake: ``timestamp`` in milliseconds from the trace start, lengths, ``hash_ids`` per 512 tokens."""

    def build(obj: dict[str, object]) -> TraceRow:
        return TraceRow(
            arrival_s=_finite_time(obj["timestamp"], "timestamp") / 1000.0,
            input_tokens=_positive_int(obj["input_length"], "input_length"),
            output_tokens=_positive_int(obj["output_length"], "output_length"),
            hash_ids=_hash_ids(obj.get("hash_ids")),
        )

    return _parse_jsonl(text, source, "mooncake", _MOONCAKE_KEYS, build)


def _optional_str(obj: dict[str, object], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _BadRow(f"{key} must be a non-empty string, got {value!r}")
    return value


def parse_native(text: str, source: str) -> Parsed:
    """Native: ``timestamp`` in seconds (float), lengths, optional hash_ids, domain, tenant, tier, text."""

    def build(obj: dict[str, object]) -> TraceRow:
        text_value = obj.get("text")
        if text_value is not None and not isinstance(text_value, str):
            raise _BadRow(f"text must be a string, got {type(text_value).__name__}")
        return TraceRow(
            arrival_s=_finite_time(obj["timestamp"], "timestamp"),
            input_tokens=_positive_int(obj["input_length"], "input_length"),
            output_tokens=_positive_int(obj["output_length"], "output_length"),
            domain=_optional_str(obj, "domain"),
            tenant=_optional_str(obj, "tenant"),
            tier=_optional_str(obj, "tier"),
            hash_ids=_hash_ids(obj.get("hash_ids")),
            text=text_value,
        )

    return _parse_jsonl(text, source, "native", _NATIVE_KEYS, build)


_PARSERS: dict[str, Callable[[str, str], Parsed]] = {
    "azure": parse_azure,
    "burstgpt": parse_burstgpt,
    "mooncake": parse_mooncake,
    "native": parse_native,
}
