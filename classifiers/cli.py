"""`polymorph` subcommands owned by the classifiers package."""

from __future__ import annotations

import argparse
from pathlib import Path

from kernels.argtypes import count, seed

_FORMATTER = argparse.ArgumentDefaultsHelpFormatter
_REPO_PARENT = Path(__file__).resolve().parents[2]


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's top-level subcommands."""
    classify = commands.add_parser(
        "classify",
        help="classify requests (JSONL in, JSONL out)",
        description=(
            "Read one request a line (an OpenAI chat body with messages, a completion body with prompt, "
            'or {"text": ...}) and write one JSON object a line in the same order: domain, '
            "domain_confidence, prompt_tokens, predicted_output_tokens {p50, p90}, tier and shape. "
            'A malformed line gets {"error": ...} in its place.'
        ),
        formatter_class=_FORMATTER,
    )
    add_classify_arguments(classify)
    classify.set_defaults(handler=_run_classify)

    group = commands.add_parser(
        "classifiers",
        help="manage the request classifier's domain model",
        description="Train and inspect the domain model the gateway uses to classify requests.",
    )
    sub = group.add_subparsers(dest="classifiers_command", metavar="<subcommand>", required=True)
    train = sub.add_parser(
        "train",
        help="train a domain model from labelled JSONL and print held-out scores",
        description=(
            'Train the domain model from labelled JSONL ({"text", "label"} a line; labels: code, math, '
            "summarization, extraction, classification, creative_writing, brainstorming, qa, chat; an optional "
            '"group" keeps related rows on one side of the held-out split). Prints per-class F1 on the held-out '
            "split, then writes the model; point the gateway at it with `classifier.model: DIR`."
        ),
        formatter_class=_FORMATTER,
    )
    add_train_arguments(train)
    train.set_defaults(handler=_run_train)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's `polymorph bench` entries."""
    bench = benches.add_parser(
        "classify",
        help="median and p99 classification time for short and 32k-token prompts",
        description=(
            "Time RequestClassifier.classify in-process on ~100-token and ~32k-token chat prompts. "
            "Targets: median <= 50 µs and p99 <= 200 µs (short); p99 <= 200 µs (long)."
        ),
        formatter_class=_FORMATTER,
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=_run_bench)


def add_classify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--in", dest="input", metavar="FILE.jsonl", default=None,
                        help="requests, one JSON object a line (default: stdin, also with '-')")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="gateway config to take shapes and classifier settings from (default: built-in shapes)")
    parser.add_argument("--tenant", default="default", help="tenant to classify as (a line's \"tenant\" wins)")
    parser.add_argument("--tier", default="standard", help="SLA tier to classify as (a line's \"tier\" wins)")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", metavar="FILE.jsonl", help='labelled JSONL, one {"text", "label"} a line')
    source.add_argument(
        "--shared", metavar="DIR", default=str(_REPO_PARENT / "shared" / "data"),
        help="the shared data folder (used when --data is not given)",
    )
    parser.add_argument("--out", metavar="DIR", default="classifier-model", help="directory to write the model to")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-bodies", type=count, default=200, help="distinct short request bodies (long: 1/20th)")
    parser.add_argument("--repeats", type=count, default=20, help="times each short body is classified")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the prompt generator")


def _run_classify(args: argparse.Namespace) -> int:
    from classifiers.classify_cli import main_classify

    return main_classify(args)


def _run_train(args: argparse.Namespace) -> int:
    from classifiers.train import main_train

    return main_train(args)


def _run_bench(args: argparse.Namespace) -> int:
    from classifiers.bench import main_bench

    return main_bench(args)

