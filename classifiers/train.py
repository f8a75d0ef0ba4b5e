"""Train, score and export the domain model.

Rebuild the shipped artefact with one command (reads ../shared/data, writes classifiers/model/):

    polymorph classifiers train --shared ../shared/data --out classifiers/model

``polymorph classifiers train --data FILE.jsonl --out DIR`` runs the same code on a user's set.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from classifiers.datasets import (
    T0_TEST_DATASETS,
    Example,
    cap_per_class,
    dedupe,
    digest_files,
    grouped_folds,
    labels_dir,
    load_jsonl_examples,
    load_shared_examples,
    load_written_examples,
    split_cross_dataset,
)
from classifiers.domain import DomainModel, analyze
from classifiers.shape import DOMAINS

MODEL_VERSION = "domain-2.0"
MAX_FEATURES = 40_000
MAX_TRAIN_PER_CLASS = 1500
REGULARIZATION_C = 20.0

TRAINING_SETS_ATTRIBUTION = [
    {"set": "gsm8k", "source": "openai/grade-school-math", "licence": "MIT", "used_as": "math"},
    {"set": "mbpp", "source": "google-research/google-research mbpp", "licence": "CC BY 4.0", "used_as": "code"},
    {
        "set": "t0",
        "source": "BigScience P3 / PromptSource templates via yizhongw/self-instruct",
        "licence": "templates Apache-2.0; each underlying dataset keeps its own licence (mostly research use)",
        "used_as": "summarization, extraction, classification, creative_writing, brainstorming, qa",
    },
    {
        "set": "alpaca seed tasks",
        "source": "tatsu-lab/stanford_alpaca (= self-instruct seed tasks)",
        "licence": "CC BY-NC 4.0 (data), Apache-2.0 (code)",
        "used_as": "classification (is_classification rows)",
    },
    {
        "set": "alpaca_eval helpful_base, oasst, koala, vicuna",
        "source": "tatsu-lab/alpaca_eval (labels: classifiers/labels/alpaca_eval.json, by the Polymorph developers)",
        "licence": "Apache-2.0 (repo); each source under its own terms (HH-RLHF MIT, OpenAssistant Apache-2.0)",
        "used_as": "all nine domains (hand-labelled)",
    },
    {
        "set": "self_instruct user-oriented instructions",
        "source": "yizhongw/self-instruct human_eval (labels: classifiers/labels/self_instruct.json, by the Polymorph developers)",
        "licence": "Apache-2.0",
        "used_as": "all nine domains (hand-labelled)",
    },
    {
        "set": "written here",
        "source": "classifiers/labels/written_here.jsonl, written by the Polymorph developers",
        "licence": "Apache-2.0 (the project's)",
        "used_as": "math (symbolic: equations, calculus, proofs), code (snippets with a question), chat (conversation), qa (quantity questions)",
    },
]


@dataclass(frozen=True, slots=True)
class Scores:
    """Held-out scores of one trained model."""

    macro_f1: float
    accuracy: float
    per_class_f1: dict[str, float]
    per_class_accuracy: dict[str, float]  # recall: share of a class's rows labelled right
    per_class_support: dict[str, int]
    num_train: int
    num_test: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "macro_f1": round(self.macro_f1, 4),
            "accuracy": round(self.accuracy, 4),
            "per_class_f1": {k: round(v, 4) for k, v in self.per_class_f1.items()},
            "per_class_accuracy": {k: round(v, 4) for k, v in self.per_class_accuracy.items()},
            "per_class_support": self.per_class_support,
            "num_train": self.num_train,
            "num_test": self.num_test,
        }


def build_pipeline(max_features: int = MAX_FEATURES, c: float = REGULARIZATION_C) -> Any:  # a sklearn Pipeline: sklearn ships no types
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    vectorizer = TfidfVectorizer(
        analyzer=analyze, binary=True, min_df=2, max_features=max_features, norm="l2", dtype=np.float64
    )
    model = LogisticRegression(C=c, class_weight="balanced", max_iter=2000)
    return Pipeline([("features", vectorizer), ("linear", model)])


def dataset_weights(examples: Sequence[Example]) -> np.ndarray:
    """Row weights under which every dataset of a class weighs the same and a class keeps its row count.

    T0 labels come from templates, so one dataset with many templates (adversarial_qa's twelve)
    would otherwise teach a class its phrasing; ``class_weight="balanced"`` then evens the classes.
    """
    per_dataset = Counter((example.label, example.dataset) for example in examples)
    datasets_per_class = Counter(label for label, _ in per_dataset)
    per_class = Counter(example.label for example in examples)
    return np.array([
        per_class[e.label] / (datasets_per_class[e.label] * per_dataset[(e.label, e.dataset)]) for e in examples
    ])


def _check_two_labels(examples: Sequence[Example]) -> None:
    if len({example.label for example in examples}) < 2:
        raise ValueError("training needs at least two distinct labels")


def fit_pipeline(examples: Sequence[Example], max_features: int = MAX_FEATURES, c: float = REGULARIZATION_C) -> Any:
    _check_two_labels(examples)
    pipeline = build_pipeline(max_features, c)
    pipeline.fit([example.text for example in examples], [example.label for example in examples],
                 linear__sample_weight=dataset_weights(examples))
    return pipeline


def export_pipeline(pipeline: Any, metadata: dict[str, Any]) -> DomainModel:
    """The pipeline's weights as a DomainModel (scikit-learn is not needed to serve it)."""
    vectorizer, linear = pipeline.named_steps["features"], pipeline.named_steps["linear"]
    coef, intercept = linear.coef_, linear.intercept_
    classes = tuple(str(name) for name in linear.classes_)
    if len(classes) == 2:  # binary LogisticRegression keeps one row: expand to a score per class
        coef, intercept = np.vstack([-coef[0] / 2, coef[0] / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
    return DomainModel(
        classes=classes,
        vocabulary={str(term): int(i) for term, i in vectorizer.vocabulary_.items()},
        idf=np.asarray(vectorizer.idf_, dtype=np.float64),
        coef=np.ascontiguousarray(coef.T, dtype=np.float64),
        intercept=np.asarray(intercept, dtype=np.float64),
        metadata=metadata,
    )


def _score_matrix(model: DomainModel, rows: Sequence[Example], classes: Sequence[str]) -> np.ndarray:
    """Decision scores in ``classes`` order; a class the model never saw scores -inf."""
    matrix = np.full((len(rows), len(classes)), -np.inf)
    columns = [classes.index(name) for name in model.classes]
    for row, example in enumerate(rows):
        matrix[row, columns] = model.scores(example.text)
    return matrix


def evaluate(truth: Sequence[str], predicted: Sequence[str], num_train: int) -> Scores:
    from sklearn.metrics import f1_score

    labels = [name for name in DOMAINS if name in set(truth)]
    f1s = f1_score(truth, predicted, labels=labels, average=None, zero_division=0)
    support = {label: truth.count(label) for label in labels}
    correct = {label: sum(1 for t, p in zip(truth, predicted) if t == label and p == label) for label in labels}
    return Scores(
        macro_f1=float(np.mean(f1s)),
        accuracy=sum(t == p for t, p in zip(truth, predicted)) / len(truth),
        per_class_f1={label: float(f1) for label, f1 in zip(labels, f1s)},
        per_class_accuracy={label: correct[label] / support[label] for label in labels},
        per_class_support=support,
        num_train=num_train,
        num_test=len(truth),
    )


def _probabilities(scores: np.ndarray, temperature: float) -> np.ndarray:
    scaled = scores / temperature
    exp = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    probabilities: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
    return probabilities


def fit_temperature(scores: np.ndarray, truth: np.ndarray) -> float:
    """The temperature that minimises the log loss of softmax(scores / T) (a 1-parameter calibration)."""
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 400))
    rows = np.arange(len(truth))
    losses = [-np.log(_probabilities(scores, t)[rows, truth] + 1e-12).mean() for t in grid]
    return float(grid[int(np.argmin(losses))])


def expected_calibration_error(scores: np.ndarray, truth: np.ndarray, temperature: float, bins: int = 10) -> float:
    """|accuracy - confidence| of the top class, averaged over equal-width confidence bins by row count."""
    probabilities = _probabilities(scores, temperature)
    confidence, correct = probabilities.max(axis=1), probabilities.argmax(axis=1) == truth
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    return float(sum(abs(correct[which == b].mean() - confidence[which == b].mean()) * (which == b).sum()
                     for b in range(bins) if (which == b).any()) / len(truth))


# The two kinds of rows are scored apart as well as together: the sets' template and source-rule
# labels on one side, and on the other the everyday requests labelled here, which are harder (chat
# against qa is a judgement) and would otherwise hide whether the sets' own rows got better or worse.
ORIGINS = {"labels of the sets": False, "labelled here": True}


@dataclass(frozen=True, slots=True)
class Report:
    """What training measured: both held-out splits and the confidence calibration."""

    grouped: Scores  # same sets, 4 folds grouped by template/source, out-of-fold predictions pooled
    cross_dataset: Scores  # whole T0 datasets held out: generality to unseen phrasing
    temperature: float
    ece_before: float  # on the pooled out-of-fold scores, temperature 1
    ece_after: float  # the same rows at the fitted temperature (in-sample for one parameter)
    # origin (ORIGINS) -> (grouped, cross-dataset) scores of that origin's held-out rows alone
    by_origin: dict[str, tuple[Scores, Scores]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "grouped_cv": {
                "what": "4-fold StratifiedGroupKFold over the same sets; a group is a T0 template with every template "
                        "sharing its source passages, an MBPP task, or one row; out-of-fold predictions pooled; "
                        "brainstorming (one template) split by source line",
                **self.grouped.as_dict(),
            },
            "cross_dataset": {
                "what": "T0 datasets " + ", ".join(sorted(T0_TEST_DATASETS)) + " held out whole; other rows 25% by group",
                **self.cross_dataset.as_dict(),
            },
            "calibration": {
                "temperature": round(self.temperature, 4),
                "ece_before": round(self.ece_before, 4),
                "ece_after": round(self.ece_after, 4),
            },
            "by_origin": {
                origin: {split: {"macro_f1": round(scores.macro_f1, 4), "accuracy": round(scores.accuracy, 4),
                                 "num_test": scores.num_test}
                         for split, scores in zip(("grouped_cv", "cross_dataset"), pair)}
                for origin, pair in self.by_origin.items()
            },
        }


def train_and_score(
    examples: Sequence[Example], seed: int = 0, max_per_class: int = MAX_TRAIN_PER_CLASS
) -> tuple[DomainModel, Report]:
    """Score both held-out splits, fit the confidence temperature, then refit on everything.

    The shipped model is the refit (it has seen every group); its metadata carries the scores of
    the models fitted without the test groups.
    """
    rng = random.Random(seed)
    examples = list(examples)
    _check_two_labels(examples)  # before the folds, whose own refusal would speak of their count
    classes = sorted({example.label for example in examples})
    tested: list[Example] = []
    fold_scores: list[np.ndarray] = []
    train_sizes = []
    for train, test in grouped_folds(examples, seed):
        model = export_pipeline(fit_pipeline(cap_per_class(train, max_per_class, rng)), {})
        tested.extend(test)
        fold_scores.append(_score_matrix(model, test, classes))
        train_sizes.append(len(train))
    oof = np.vstack(fold_scores)
    truth = [example.label for example in tested]
    truth_ids = np.array([classes.index(label) for label in truth])
    oof_predicted = [classes[i] for i in oof.argmax(axis=1)]
    grouped_num_train = round(float(np.mean(train_sizes)))
    grouped = evaluate(truth, oof_predicted, grouped_num_train)
    temperature = fit_temperature(oof, truth_ids)

    train, test = split_cross_dataset(examples, seed)
    if not train or not test:
        raise ValueError("the cross-dataset split left one side empty: add more rows or groups")
    cross_model = export_pipeline(fit_pipeline(cap_per_class(train, max_per_class, rng)), {})
    cross_predicted = [cross_model.predict(example.text)[0] for example in test]
    cross = evaluate([example.label for example in test], cross_predicted, len(train))

    by_origin: dict[str, tuple[Scores, Scores]] = {}
    if len({example.labelled_here for example in examples}) == len(ORIGINS):  # one origin alone: the totals say it
        for origin, labelled_here in ORIGINS.items():
            grouped_rows = [i for i, example in enumerate(tested) if example.labelled_here == labelled_here]
            cross_rows = [i for i, example in enumerate(test) if example.labelled_here == labelled_here]
            if not grouped_rows or not cross_rows:
                continue
            by_origin[origin] = (
                evaluate([truth[i] for i in grouped_rows], [oof_predicted[i] for i in grouped_rows], grouped_num_train),
                evaluate([test[i].label for i in cross_rows], [cross_predicted[i] for i in cross_rows], len(train)),
            )

    final = export_pipeline(fit_pipeline(cap_per_class(examples, max_per_class, rng)), {})
    report = Report(grouped, cross, temperature, expected_calibration_error(oof, truth_ids, 1.0),
                    expected_calibration_error(oof, truth_ids, temperature), by_origin)
    return replace(final, temperature=temperature), report


def _metadata(report: Report, data_digest: str, data_desc: str, attribution: list[dict[str, Any]]) -> dict[str, Any]:
    import sklearn

    return {
        "model_version": MODEL_VERSION,
        "sklearn_version": sklearn.__version__,
        "numpy_version": np.__version__,
        "training_data": data_desc,
        "training_data_sha256": data_digest,
        "held_out_scores": report.as_dict(),
        "attribution": attribution,
    }


def print_scores(scores: Scores, title: str, out: TextIO = sys.stdout) -> None:
    print(f"{title}: held-out rows {scores.num_test} (trained on {scores.num_train})", file=out)
    print(f"{'domain':<18}{'support':>8}{'F1':>8}{'acc':>8}", file=out)
    for label, f1 in scores.per_class_f1.items():
        print(
            f"{label:<18}{scores.per_class_support[label]:>8}{f1:>8.3f}{scores.per_class_accuracy[label]:>8.3f}",
            file=out,
        )
    print(f"{'macro-F1':<18}{'':>8}{scores.macro_f1:>8.3f}{scores.accuracy:>8.3f}", file=out)


def print_report(report: Report, out: TextIO = sys.stdout) -> None:
    print_scores(report.grouped, "grouped 4-fold CV (same sets, templates/sources never on both sides)", out)
    print_scores(report.cross_dataset, "cross-dataset (T0 datasets held out whole)", out)
    for origin, (grouped, cross) in report.by_origin.items():
        print(f"{origin}: grouped macro-F1 {grouped.macro_f1:.3f} acc {grouped.accuracy:.3f} ({grouped.num_test} rows); "
              f"cross-dataset macro-F1 {cross.macro_f1:.3f} acc {cross.accuracy:.3f} ({cross.num_test} rows)", file=out)
    print(f"confidence temperature {report.temperature:.3f}: ECE {report.ece_before:.3f} -> {report.ece_after:.3f}",
          file=out)


def train_to_dir(examples: Sequence[Example], out_dir: Path, data_digest: str, data_desc: str,
                 attribution: list[dict[str, Any]]) -> Report:
    model, report = train_and_score(examples)
    replace(model, metadata=_metadata(report, data_digest, data_desc, attribution)).save(out_dir)
    return report


def main_train(args: argparse.Namespace) -> int:
    """`polymorph classifiers train`: from a user's JSONL (--data) or the shared sets (--shared)."""
    try:
        if args.data is not None:
            data_path = Path(args.data)
            examples = load_jsonl_examples(data_path)
            digest, desc, attribution = digest_files([data_path]), str(data_path.name), []
        else:
            shared = Path(args.shared)
            examples = dedupe([*load_shared_examples(shared), *load_written_examples()])
            files = sorted((shared / "prompts" if (shared / "prompts").is_dir() else shared).glob("*/prompts.jsonl*"))
            labels = sorted(labels_dir().glob("*.json*"))
            digest, desc, attribution = digest_files([*files, *labels]), "shared prompt sets: " + ", ".join(
                f.parent.name for f in files) + "; with classifiers/labels", TRAINING_SETS_ATTRIBUTION
        report = train_to_dir(examples, Path(args.out), digest, desc, attribution)
    except (OSError, ValueError) as exc:  # a missing or malformed set names its file and line; an unwritable --out its path
        print(f"polymorph classifiers train: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    print(f"model written to {args.out}")
    return 0

