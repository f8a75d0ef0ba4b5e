"""Trace readers: every format parses, bad rows are reported by line and skipped, wrong formats are named."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from kernels.traces import RowIssue
from loadtest.traces import TraceFormatError, read_trace, sniff_format, write_native

FIXTURES = Path(__file__).parent / "fixtures"


def test_azure_rows_become_seconds_from_the_first_request_and_bad_rows_are_reported() -> None:
    workload = read_trace(FIXTURES / "azure_small.csv", "azure", domain="code")
    assert [spec.input_tokens for spec in workload.specs] == [374, 396, 879, 91]
    assert [spec.output_tokens for spec in workload.specs] == [44, 109, 55, 16]
    assert [round(spec.arrival_s, 6) for spec in workload.specs] == [0.0, 4.314579, 4.541877, 10.0]
    assert {spec.domain for spec in workload.specs} == {"code"}
    assert [issue.line for issue in workload.issues] == [5, 6, 7]
    assert "TIMESTAMP" in workload.issues[0].reason
    assert "ContextTokens" in workload.issues[1].reason
    assert workload.duration_s == pytest.approx(10.0)


def test_burstgpt_skips_failed_requests_and_bad_times() -> None:
    workload = read_trace(FIXTURES / "burstgpt_small.csv", "burstgpt")
    assert [(spec.arrival_s, spec.input_tokens, spec.output_tokens) for spec in workload.specs] == [
        (0.0, 472, 18),
        (113.0, 417, 276),
        (125.5, 12, 7),
    ]
    assert [spec.label for spec in workload.specs] == ["ChatGPT", "GPT-4", "ChatGPT"]
    assert workload.issues == (
        RowIssue(3, "Response tokens is 0 (a failed request in BurstGPT)"),
        RowIssue(5, "Timestamp is not a number: 'abc'"),
    )


def test_mooncake_keeps_hash_ids_and_converts_milliseconds() -> None:
    workload = read_trace(FIXTURES / "mooncake_small.jsonl", "mooncake")
    assert [spec.arrival_s for spec in workload.specs] == [0.0, 0.25, 0.25, 2.5]
    assert [spec.hash_ids for spec in workload.specs] == [(0, 1, 2), (0, 1, 3), (4, 5), (0, 1, 2)]
    assert [issue.line for issue in workload.issues] == [4, 5, 6]
    assert workload.issues[0].reason == "missing output_length"
    assert "hash_ids" in workload.issues[1].reason
    assert workload.issues[2].reason == "not valid JSON"


def test_a_byte_order_mark_crlf_lines_and_gzip_are_read_as_exported(tmp_path: Path) -> None:
    # Azure's 2024 trace spells TIMESTAMP with a UTC offset; a spreadsheet export adds a BOM and CRLFs
    exported = tmp_path / "azure2024.csv"
    exported.write_bytes("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                         "2024-05-10 00:00:00.009930+00:00,4808,10\r\n2024-05-10 00:00:01.509930+00:00,110,27\r\n"
                         "2024-05-10 02:00:02.5+02:00,64,8\r\n".encode())
    workload = read_trace(exported, "azure")
    assert [(round(s.arrival_s, 6), s.input_tokens, s.output_tokens) for s in workload.specs] == [
        (0.0, 4808, 10), (1.5, 110, 27), (2.49007, 64, 8)]  # the offset counts, a short fraction too
    assert workload.issues == ()
    packed = tmp_path / "mooncake_small.jsonl.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write((FIXTURES / "mooncake_small.jsonl").read_text())
    assert read_trace(packed, "mooncake").specs == read_trace(FIXTURES / "mooncake_small.jsonl", "mooncake").specs
    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(b'{"timestamp": 0}\n')[:12])
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "broken.jsonl.gz", "mooncake")


def test_native_reads_optional_fields_and_round_trips(tmp_path: Path) -> None:
    workload = read_trace(FIXTURES / "native_small.jsonl", "native")
    first, second, third = workload.specs
    assert (first.domain, first.tenant, first.tier) == ("code", "acme", "interactive")
    assert second.hash_ids == (7, 8, 9, 10) and second.tier == "batch"
    assert third.text == "What is the capital of France?" and third.tenant == "default"
    assert [issue.line for issue in workload.issues] == [5, 6, 7]
    write_native(workload, tmp_path / "copy.jsonl")
    again = read_trace(tmp_path / "copy.jsonl", "native")
    assert again.specs == tuple(spec.__class__(**{**_fields(spec), "label": "copy"}) for spec in workload.specs)


def _fields(spec: object) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__slots__}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fixture", "wrong_format", "guessed"),
    [
        ("azure_small.csv", "mooncake", "azure"),
        ("mooncake_small.jsonl", "azure", "mooncake"),
        ("burstgpt_small.csv", "azure", "burstgpt"),
        ("native_small.jsonl", "burstgpt", "native"),
    ],
)
def test_a_wrong_format_is_named_with_a_hint(fixture: str, wrong_format: str, guessed: str) -> None:
    with pytest.raises(TraceFormatError) as caught:
        read_trace(FIXTURES / fixture, wrong_format)
    message = str(caught.value)
    assert wrong_format in message and f"--format {guessed}" in message


def test_unknown_format_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown trace format 'csv'"):
        read_trace(FIXTURES / "azure_small.csv", "csv")
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "absent.csv", "azure")


def test_mostly_bad_rows_mean_the_wrong_format(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 1}\n{"x": 2}\n{"y": 3}\n{"timestamp": 0, "input_length": 5, "output_length": 5}\n')
    with pytest.raises(TraceFormatError, match="3 of 4 rows are not valid native rows"):
        read_trace(path, "native")


def test_sniff_format_recognises_each_fixture() -> None:
    names = {"azure_small.csv": "azure", "burstgpt_small.csv": "burstgpt",
             "mooncake_small.jsonl": "mooncake", "native_small.jsonl": "native"}
    for name, expected in names.items():
        assert sniff_format((FIXTURES / name).read_text()) == expected


def test_shared_azure_traces_parse_completely(shared_dir: Path) -> None:
    folder = shared_dir / "data" / "traces" / "azure2023"
    code = read_trace(folder / "AzureLLMInferenceTrace_code.csv", "azure", domain="code")
    assert code.num_requests == 8819 and not code.issues
    assert 3430 < code.duration_s < 3440
