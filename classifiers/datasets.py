"""Labelled prompts for the domain model: the shared sets, a user's JSONL, and a group-aware split.

Offline only (training and evaluation); the gateway never reads these files. The shared prompt
sets live in ``../shared/data/prompts``: see each folder's SOURCE.md for provenance and licence.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from classifiers.shape import DOMAINS

# The shared sets use a finer label set than the gateway's domains.
SHARED_LABEL_TO_DOMAIN: dict[str, str] = {
    "open_qa": "qa",
    "closed_qa": "qa",
    "general_chat": "chat",
    **{domain: domain for domain in DOMAINS},
}

# Sets that ship without task labels and are labelled by this package (classifiers/labels/<set>.json,
# keyed by a row's id or idx, says by whom and what was left out): the Self-Instruct user-oriented
# instructions and AlpacaEval's helpful-base, Open Assistant, Koala and Vicuna requests are what people
# actually type (emails, posts, recipes, code, questions), a register no labelled set has. Without them
# "Write a ..." meant code (MBPP's phrasing), so "Write a haiku" was code at 0.98.
LABELLED_HERE = ("alpaca_eval", "self_instruct")
WRITTEN_HERE = "written_here.jsonl"
VICUNA_FIRST_IDX = 725  # AlpacaEval's rows from idx 725 on are Vicuna's, in its blocks of ten

# Cross-dataset split: these T0 datasets are held out whole, so every test prompt comes from a
# dataset (and templates) training never saw. Chosen so every class keeps training data.
T0_TEST_DATASETS = frozenset(
    {"gigaword", "wiki_bio", "sciq", "yelp_review_full", "glue_qqp", "quartz", "ropes", "wiki_qa", "dream"}
)
# Classes whose shared rows all come from one T0 template (brainstorming: cnn_dailymail
# "spice_up_story"): no split can keep the template off one side, so they are split by source line
# and their scores are flagged as same-template.
SINGLE_TEMPLATE_CLASSES = frozenset({"brainstorming"})
TEST_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: str  # one of DOMAINS
    group: str  # rows sharing a group (template, source document, task) land on the same side of a split
    source: str
    dataset: str = ""  # the set a row comes from ("t0/gigaword", "gsm8k"): the cross-dataset split's unit
    labelled_here: bool = False  # the label is ours (LABELLED_HERE), not the set's or a source rule's


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


class _UnionFind:
    """Connected components of string keys (T0 templates linked through the source documents they share)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def labels_dir() -> Path:
    """Where the package keeps the labels and prompts of its own (LABELLED_HERE, WRITTEN_HERE)."""
    return Path(str(resources.files("classifiers") / "labels"))


@cache
def labels_here(set_name: str) -> dict[str, str]:
    """Row key (its ``id``, else its ``idx``, as a string) -> domain for a set in LABELLED_HERE."""
    labels: dict[str, str] = json.loads((labels_dir() / f"{set_name}.json").read_text(encoding="utf-8"))["labels"]
    return labels


def _shared_rows(prompts_dir: Path) -> Iterator[tuple[str, dict[str, Any], int]]:
    for path in sorted(prompts_dir.glob("*/prompts.jsonl*")):
        folder = path.parent.name
        ours = labels_here(folder) if folder in LABELLED_HERE else {}
        for row_num, row in enumerate(_read_jsonl(path)):
            text = row.get("text")
            label = row.get("label")
            labelled_here = label is None and bool(ours)
            if labelled_here:
                label = ours.get(str(row.get("id", row.get("idx"))))
            if isinstance(text, str) and text.strip() and label is not None:
                yield folder, {**row, "label": label, "labelled_here": labelled_here}, row_num


def _t0_groups(rows: list[tuple[str, dict[str, Any], int]]) -> dict[str, str]:
    """T0 template -> leak group: templates of a dataset that share a source document share a group.

    PromptSource applies several templates to the same passages (a template covers 40 source lines
    of its dataset), so grouping by template alone would put one passage on both sides of a split.
    """
    components = _UnionFind()
    for folder, row, _ in rows:
        if folder == "t0" and SHARED_LABEL_TO_DOMAIN[row["label"]] not in SINGLE_TEMPLATE_CLASSES:
            components.union(f"template/{row['template']}", f"line/{row['dataset']}/{row['line']}")
    return {key[len("template/"):]: f"t0/{components.find(key)}" for key in components.parent if key.startswith("template/")}


_NON_WORD = re.compile(r"[\W_]+")


def normalise(text: str) -> str:
    """Dedup key: case, whitespace and punctuation do not make two prompts different."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def _shared_examples(prompts_dir: Path) -> Iterator[Example]:
    rows = list(_shared_rows(prompts_dir))
    t0_groups = _t0_groups(rows)
    for folder, row, row_num in rows:
        text, domain = row["text"], SHARED_LABEL_TO_DOMAIN[row["label"]]
        dataset = folder
        if folder == "t0":
            dataset = f"t0/{row['dataset']}"
            group = t0_groups.get(row["template"], f"{dataset}/{row['template']}/{row['line']}")
        elif folder == "mbpp":
            group = f"mbpp/{row['task_id']}"
        elif folder == "self_instruct":
            group = f"self_instruct/{row.get('motivation_app', row_num)}"  # an app's tasks share phrasing
        elif folder == "alpaca_eval":
            dataset = f"alpaca_eval/{row.get('dataset')}"  # helpful-base, Koala, ...: each weighs as one set
            # Vicuna's questions come in blocks of ten sharing a template ("How many ...? Try to explain")
            block = (row.get("idx", VICUNA_FIRST_IDX) - VICUNA_FIRST_IDX) // 10
            group = f"{dataset}/{block}" if row.get("dataset") == "vicuna" else f"{folder}/{row_num}"
        else:
            group = f"{folder}/{row_num}"
        yield Example(text, domain, group, folder, dataset, row["labelled_here"])
        with_tests = row.get("text_with_tests")
        if isinstance(with_tests, str) and with_tests != text:
            # MBPP as its paper prompts it (task + asserts): code-looking text, same group
            yield Example(with_tests, domain, group, folder, dataset, row["labelled_here"])


def dedupe(examples: Iterable[Example]) -> list[Example]:
    """The first of each set of prompts equal after :func:`normalise` (the sets repeat some prompts)."""
    seen: set[str] = set()
    kept: list[Example] = []
    for example in examples:
        key = normalise(example.text)
        if key not in seen:
            seen.add(key)
            kept.append(example)
    return kept


def load_shared_examples(data_dir: Path) -> list[Example]:
    """Every distinct labelled prompt under ``data_dir`` (the shared ``data`` folder or its ``prompts``)."""
    prompts_dir = data_dir / "prompts" if (data_dir / "prompts").is_dir() else data_dir
    examples = dedupe(_shared_examples(prompts_dir))
    if not examples:
        raise ValueError(f"no labelled prompts under {prompts_dir}")
    return examples


def load_written_examples() -> list[Example]:
    """Prompts written for this package (classifiers/labels/written_here.jsonl) where no public set has
    the register: symbolic math (equations, calculus, proofs: GSM8K is all word problems, so "Solve
    3x + 5 = 20" read as code by MBPP's symbols), code bodies with a question about them (so the
    math rows' symbols do not pull snippets over to math), conversation (small talk, feelings,
    personal advice, role-play, follow-ups: no set labels chat, and the requests labelled here that
    are chat are few), and factual quantity questions ("How many legs does a spider have?": GSM8K
    made every "How many ..." math)."""
    text = (labels_dir() / WRITTEN_HERE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Example(row["text"], SHARED_LABEL_TO_DOMAIN[row["label"]], f"written_here/{i}", "written_here", "written_here", True)
            for i, row in enumerate(rows)]


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


def _hashed_to_test(group: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION


def _in_cross_dataset_test(example: Example, seed: int) -> bool:
    if example.dataset.startswith("t0/") and example.label not in SINGLE_TEMPLATE_CLASSES:
        return example.dataset[3:] in T0_TEST_DATASETS
    return _hashed_to_test(example.group, seed)


def split_cross_dataset(examples: Iterable[Example], seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Generality split: T0_TEST_DATASETS held out whole, other rows by group (deterministic for a seed)."""
    train: list[Example] = []
    test: list[Example] = []
    for example in examples:
        (test if _in_cross_dataset_test(example, seed) else train).append(example)
    return train, test


def grouped_folds(examples: Sequence[Example], seed: int = 0) -> Iterator[tuple[list[Example], list[Example]]]:
    """(train, test) folds of the same sets: each row is tested once, no group on both sides of a fold.

    Scikit-learn's StratifiedGroupKFold (1/TEST_FRACTION folds) balances the classes over whole
    groups, so a T0 template and the passages it shares with other templates stay on one side.
    """
    from sklearn.model_selection import StratifiedGroupKFold

    num_folds = round(1 / TEST_FRACTION)
    labels = [example.label for example in examples]
    # scikit-learn's own refusals ("n_splits=4 cannot be greater than the number of members in each
    # class") name none of the user's terms: say what the file lacks
    num_groups, largest = len({example.group for example in examples}), max(Counter(labels).values(), default=0)
    if num_groups < num_folds or largest < num_folds:
        raise ValueError(f"the held-out scores need {num_folds} folds: at least {num_folds} rows of one label and "
                         f"{num_folds} groups (rows without a \"group\", or distinct \"group\" values); "
                         f"got {len(labels)} rows in {num_groups} groups, the largest label {largest} rows")
    folds = StratifiedGroupKFold(n_splits=num_folds, shuffle=True, random_state=seed)
    for train_rows, test_rows in folds.split(labels, labels, [example.group for example in examples]):
        yield [examples[i] for i in train_rows], [examples[i] for i in test_rows]


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
