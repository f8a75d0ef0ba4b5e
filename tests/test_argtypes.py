"""Numeric flags out of range and URLs that are not http(s) are refused by argparse (kernels.argtypes), on every command."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from gateway.cli import _parsers, build_parser
from kernels.argtypes import count, count_or_zero, counts, fraction, http_url, is_http_url, non_negative, port, positive, positives, seed

# Flags whose plain int or float is meant: any value is a status, or a time whose negative
# value means "forever" (the emulator's faults).
PLAIN = frozenset({"--error-status", "--hang-before-first-byte-s", "--stall-s",
                   "--refuse-connections-s"})


def test_each_type_takes_its_range_and_refuses_the_rest() -> None:
    assert (count("3"), count_or_zero("0"), positive("0.5"), non_negative("0"), fraction("1")) == (3, 0, 0.5, 0.0, 1.0)
    assert counts("16, 64") == (16, 64) and positives("500,1e3") == (500.0, 1000.0) and (port("0"), port("65535")) == (0, 65535)
    for kind, text in ((count, "0"), (count, "1.5"), (count_or_zero, "-1"), (positive, "0"), (positive, "nan"),
                       (positive, "inf"), (non_negative, "-0.1"), (fraction, "1.5"), (counts, "16,0"), (positives, ","),
                       (port, "-1"), (port, "65536")):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


def _typed_flags() -> Iterator[tuple[argparse.ArgumentParser, str, object]]:
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.type is not None:
                yield parser, action.option_strings[-1], action.type


def test_no_numeric_flag_takes_any_number_but_a_status_and_forever_delays() -> None:
    plain = [f"{parser.prog} {flag}" for parser, flag, kind in _typed_flags() if kind in (int, float) and flag not in PLAIN]
    assert plain == []


def test_a_zero_or_a_negative_is_refused_where_the_flag_needs_more(capsys: pytest.CaptureFixture[str]) -> None:
    floors = {count: "0", positive: "0", counts: "0", positives: "0", non_negative: "-1", count_or_zero: "-1", fraction: "2",
              port: "70000", seed: "-1"}
    checked = 0
    for parser, flag, kind in _typed_flags():
        if kind in floors:
            with pytest.raises(SystemExit) as stopped:
                parser.parse_args([flag, floors[kind]])
            err = capsys.readouterr().err  # the flag's own error, not a missing required one
            assert stopped.value.code == 2 and f"argument {flag}" in err and "must be" in err, (parser.prog, flag, err)
            checked += 1
    assert checked > 80  # the sweep reached the commands' flags


def test_a_url_needs_http_or_https_and_a_host() -> None:
    assert http_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080" and is_http_url("https://[::1]:443/v1")
    for text in ("ftp://x", "127.0.0.1:8080", "http://", "http://a b", "http://a:port"):
        assert not is_http_url(text), text
        with pytest.raises(argparse.ArgumentTypeError):
            http_url(text)


def test_every_url_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """--upstream, --target and demo's --url: before, `serve --upstream ftp://x` served, and failed each request."""
    url_flags = [(parser, flag) for parser, flag, kind in _typed_flags() if kind is http_url]
    assert {flag for _, flag in url_flags} >= {"--upstream", "--target", "--url"}
    for parser, flag in url_flags:
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args([flag, "ftp://x"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"argument {flag}" in err and "http://" in err, (parser.prog, flag, err)
