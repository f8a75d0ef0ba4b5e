"""Labelled prompts for the domain model: the shared sets, a user's JSONL, and a group-aware split.

Offline only (training and evaluation); the gateway never reads these files. The shared prompt
sets live in ``../shared/data/prompts``: see each folder's SOURCE.md for provenance and licence.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from classifiers.shape import DOMAINS

# The shared sets use a finer label set than the gateway's domains.
SHARED_LABEL_TO_DOMAIN: dict[str, str] = {
    "open_qa": "qa",
    "closed_qa": "qa",
    "general_chat": "chat",
    **{domain: domain for domain in DOMAINS},
}

# No shared set carries a general_chat label. Anthropic helpful-base first turns (inside the
# AlpacaEval set) are open conversational requests, so they stand in for `chat` by a source rule,
# the same way T0's labels come from a (dataset, template) rule. README.md says so next to the score.
WEAK_CHAT_DATASETS = frozenset({"helpful_base"})

# T0 datasets held out whole (grouped split): T0 text is templated, so a row split would put the
# same template and source document on both sides. Chosen so every class keeps training data.
T0_TEST_DATASETS = frozenset(
    {"gigaword", "wiki_bio", "sciq", "yelp_review_full", "glue_qqp", "quartz", "ropes", "wiki_qa", "dream"}
)
TEST_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: str  # one of DOMAINS
    group: str  # rows sharing a group land on the same side of the split
    source: str


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _shared_examples(prompts_dir: Path) -> Iterator[Example]:
    for path in sorted(prompts_dir.glob("*/prompts.jsonl*")):
        folder = path.parent.name
        for row_num, row in enumerate(_read_jsonl(path)):
            text = row.get("text")
            if not isinstance(text, str) or not text.strip():
                continue
            label = row.get("label")
            if label is None and row.get("dataset") in WEAK_CHAT_DATASETS:
                label = "general_chat"
            if label is None:
                continue
            domain = SHARED_LABEL_TO_DOMAIN[label]
            if folder == "t0":
                dataset = row["dataset"]
                # brainstorming comes from a single T0 template: hold out by source line instead
                group = f"t0/{dataset}" if domain != "brainstorming" else f"t0/{dataset}/{row['line']}"
            elif folder == "mbpp":
                group = f"mbpp/{row['task_id']}"
            else:
                group = f"{folder}/{row_num}"
            yield Example(text, domain, group, folder)
            with_tests = row.get("text_with_tests")
            if isinstance(with_tests, str) and with_tests != text:
                # MBPP as its paper prompts it (task + asserts): code-looking text, same group
                yield Example(with_tests, domain, group, folder)


def load_shared_examples(data_dir: Path) -> list[Example]:
    """Every labelled prompt under ``data_dir`` (the shared ``data`` folder or its ``prompts``)."""
    prompts_dir = data_dir / "prompts" if (data_dir / "prompts").is_dir() else data_dir
    examples = list(_shared_examples(prompts_dir))
    if not examples:
        raise ValueError(f"no labelled prompts under {prompts_dir}")
    return examples


def load_jsonl_examples(path: Path) -> list[Example]:
    """A user's labelled JSONL: one ``{"text": str, "label": str}`` a line (labels: DOMAINS or shared names)."""
    examples: list[Example] = []
    for line_num, row in enumerate(_read_jsonl(path), start=1):
        text, label = row.get("text"), row.get("label")
        if not isinstance(text, str) or not isinstance(label, str):
            raise ValueError(f"{path}:{line_num}: expected {{'text': str, 'label': str}}")
        domain = SHARED_LABEL_TO_DOMAIN.get(label)
        if domain is None:
            raise ValueError(f"{path}:{line_num}: unknown label {label!r}; use one of {', '.join(DOMAINS)}")
        group = row.get("group")
        examples.append(Example(text, domain, str(group) if group is not None else f"row/{line_num}", path.name))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def _in_test(group: str, seed: int) -> bool:
    if group.startswith("t0/") and "/" not in group[3:]:
        return group[3:] in T0_TEST_DATASETS
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION


def split_by_group(examples: Iterable[Example], seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Train/test split where a group never straddles the two sides (deterministic for a seed)."""
    train: list[Example] = []
    test: list[Example] = []
    for example in examples:
        (test if _in_test(example.group, seed) else train).append(example)
    return train, test


def cap_per_class(examples: list[Example], max_per_class: int, rng: random.Random) -> list[Example]:
    """At most ``max_per_class`` examples of each label (GSM8K alone would outnumber every other class)."""
    by_label: dict[str, list[Example]] = {}
    for example in examples:
        by_label.setdefault(example.label, []).append(example)
    kept: list[Example] = []
    for label in sorted(by_label):
        rows = by_label[label]
        kept.extend(rows if len(rows) <= max_per_class else rng.sample(rows, max_per_class))
    return kept


def digest_files(paths: Iterable[Path]) -> str:
    """sha256 over the named files' bytes, in sorted path order (the training data digest)."""
    hasher = hashlib.sha256()
    for path in sorted(paths):
        hasher.update(path.name.encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()
