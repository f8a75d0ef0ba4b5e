"""`polymorph classify`: one request a JSONL line in, one classification a line out, same order."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from classifiers.config import ClassifierConfigError, load_classifier_config
from classifiers.request import ClassifierLoadError, RequestClassifier


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and (message.get("content") is None or isinstance(message.get("content"), (str, list)))
    )


def _body_of(row: object) -> tuple[dict[str, Any], bool]:
    """(body, chat) of one input line; raises ValueError with a message for the error object."""
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(map(_is_message, messages)):
            raise ValueError("messages must be a list of {role, content} objects")
        return row, True
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string, a list of strings or token ids")
        return row, False
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError("text must be a string")
        return {**row, "prompt": row["text"]}, False
    raise ValueError('expected "messages", "prompt" or "text"')


def classify_lines(classifier: RequestClassifier, lines: Iterable[bytes], tenant: str, tier: str) -> Iterator[dict[str, Any]]:
    """One output object per non-blank input line: a classification or {"error": ...}.

    Lines are bytes and decoded one by one, so a line that is not UTF-8 costs only itself.
    """
    for line_num, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            # utf-8-sig on the first line: an editor's byte-order mark is not part of the JSON
            line = raw.decode("utf-8-sig" if line_num == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            yield {"error": f"line {line_num}: not UTF-8 text (byte {exc.start})"}
            continue
        try:
            body, chat = _body_of(json.loads(line))
        except (json.JSONDecodeError, ValueError) as exc:
            yield {"error": f"line {line_num}: {exc}"}
            continue
        row_tier, row_tenant = body.get("tier"), body.get("tenant")
        row_tier = row_tier if isinstance(row_tier, str) else tier
        row_tenant = row_tenant if isinstance(row_tenant, str) else tenant
        shape = classifier.classify(body, chat=chat, tenant=row_tenant, tier=row_tier)
        yield {
            "domain": shape.domain,
            "domain_confidence": round(shape.domain_confidence, 4),
            "prompt_tokens": shape.prompt_tokens,
            "predicted_output_tokens": {"p50": shape.predicted_output_p50, "p90": shape.predicted_output_p90},
            "tier": shape.tier,
            "shape": shape.name,
        }


def main_classify(args: argparse.Namespace) -> int:
    try:
        settings = load_classifier_config(Path(args.config) if args.config else None)
        classifier = RequestClassifier.load(settings.model, settings.tokenizer, settings.rules)
    except (ClassifierConfigError, ClassifierLoadError) as exc:
        print(f"polymorph classify: {exc}", file=sys.stderr)
        return 2
    if args.input in (None, "-"):
        return _write_all(classifier, sys.stdin.buffer, args)
    try:
        with open(args.input, "rb") as source:
            return _write_all(classifier, source, args)
    except OSError as exc:
        print(f"polymorph classify: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2


def _write_all(classifier: RequestClassifier, source: BinaryIO, args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        for result in classify_lines(classifier, source, args.tenant, args.tier):
            out.write(json.dumps(result) + "\n")
        out.flush()
    except BrokenPipeError:
        # The reader left (`polymorph classify ... | head`): stop quietly, as Unix filters do. stdout
        # now points at /dev/null, so the interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return 0
