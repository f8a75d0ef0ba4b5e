"""`polymorph classify` and `polymorph classifiers train` as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_RUN = (
    "import argparse, sys\n"
    "from classifiers import cli\n"
    "p = argparse.ArgumentParser(prog='polymorph'); c = p.add_subparsers(dest='command', required=True)\n"
    "cli.register(c)\n"
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))\n"
)


def _polymorph(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, *args], input=stdin, capture_output=True, text=True,
                          timeout=120, check=False)


def test_classify_keeps_order_and_reports_malformed_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "Write a Python function to add."}]}),
        "{not json",
        json.dumps({"prompt": "Summarize this article: the city council met today."}),
        json.dumps({"messages": "nope"}),
        json.dumps({"text": "Tom has 3 apples and buys 4 more. How many apples does he have?"}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = _polymorph("classify", "--in", str(source), "--tier", "batch")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 5 and "error" in rows[1] and "error" in rows[3]
    assert rows[0]["domain"] == "code" and rows[4]["domain"] == "math"
    assert set(rows[2]) == {"domain", "domain_confidence", "prompt_tokens", "predicted_output_tokens", "tier", "shape"}
    assert rows[0]["tier"] == "batch" and rows[0]["shape"] == "batch"
    assert set(rows[0]["predicted_output_tokens"]) == {"p50", "p90"}


def test_classify_reads_stdin_and_config_shapes(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("shapes:\n  - name: tiny\n    max_prompt_tokens: 50\ndefault_shape: big\n")
    result = _polymorph("classify", "--config", str(config), stdin=json.dumps({"text": "hello"}) + "\n")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["shape"] == "tiny"
    bad = tmp_path / "bad.yaml"
    bad.write_text("classifier:\n  model: does-not-exist\n")
    failed = _polymorph("classify", "--config", str(bad), stdin="")
    assert failed.returncode == 2 and "classifier.model" in failed.stderr


def test_classify_answers_a_line_that_is_not_utf8_with_an_error_and_skips_a_bom(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'\xef\xbb\xbf{"text": "Write a poem about rain."}\n\xff\xfe{"text": 1}\n{"text": "caf\xc3\xa9 menu"}\n')
    result = _polymorph("classify", "--in", str(source))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [min(row) for row in rows] == ["domain", "error", "domain"]
    assert rows[1]["error"] == "line 2: not UTF-8 text (byte 0)"


def test_classify_stops_quietly_when_its_reader_leaves() -> None:
    lines = "".join(json.dumps({"text": f"question {i}"}) + "\n" for i in range(1500))  # fits a pipe buffer: no writer thread
    with subprocess.Popen([sys.executable, "-c", _RUN, "classify"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as child:
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        child.stdin.write(lines.encode())
        child.stdin.close()
        child.stdout.readline()
        child.stdout.close()  # as `| head -1` does
        assert child.wait(timeout=120) == 0
        assert b"Traceback" not in child.stderr.read()


def test_train_writes_a_model_the_classifier_loads(tmp_path: Path) -> None:
    data = tmp_path / "labelled.jsonl"
    texts = {
        "code": ["write a python function to reverse a list", "implement a function to sort an array"],
        "math": ["how many apples are left if she eats 3 of 12", "a car drives 40 miles per hour for 2 hours"],
    }
    rows = [{"text": f"{t} {i}", "label": label, "group": f"{label}{i % 4}"}
            for label, ts in texts.items() for t in ts for i in range(8)]
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    out = tmp_path / "model"
    result = _polymorph("classifiers", "train", "--data", str(data), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "macro-F1" in result.stdout and (out / "metadata.json").is_file()
    config = tmp_path / "gateway.yaml"
    config.write_text(f"classifier:\n  model: {out}\n")
    classified = _polymorph("classify", "--config", str(config), stdin=json.dumps({"text": "reverse a list"}) + "\n")
    assert json.loads(classified.stdout)["domain"] in {"code", "math"}


def test_train_on_a_missing_or_malformed_set_or_an_unwritable_out_says_why_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": 1}) + "\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    good = tmp_path / "labelled.jsonl"
    good.write_text("".join(json.dumps({"text": f"{text} {i}", "label": label, "group": f"{label}{i % 4}"}) + "\n"
                            for label, text in (("code", "write a python function"), ("math", "how many apples are left")) for i in range(8)))
    one_label = tmp_path / "one-label.jsonl"
    one_label.write_text("".join(json.dumps({"text": f"hi {i}", "label": "chat"}) + "\n" for i in range(8)))
    too_few = tmp_path / "too-few.jsonl"  # before: scikit-learn's "n_splits=4 cannot be greater than ..."
    too_few.write_text("".join(json.dumps({"text": f"hi {i}", "label": label}) + "\n" for i in range(2) for label in ("chat", "code")))
    for argv, says in ((["--data", str(tmp_path / "missing.jsonl")], "No such file"),
                       (["--data", str(bad)], f"{bad}:1: expected"),
                       (["--data", str(one_label)], "at least two distinct labels"),
                       (["--data", str(too_few)], "need 4 folds: at least 4 rows of one label and 4 groups"),
                       (["--shared", str(tmp_path)], "no labelled prompts"),
                       (["--data", str(good), "--out", str(blocker / "model")], "a-file")):
        result = _polymorph("classifiers", "train", *argv)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
