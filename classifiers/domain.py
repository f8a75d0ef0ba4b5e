"""Domain of a prompt: word and bigram features, a linear model, and a lean inference path.

Training builds a scikit-learn pipeline (``TfidfVectorizer`` over :func:`analyze`, then a
multinomial ``LogisticRegression``). Serving does not call scikit-learn: the vectorizer's
vocabulary is a dict, so a prompt's features are dict look-ups and its scores one sparse dot
product in numpy, the same numbers scikit-learn computes without its per-call overhead
(tests/classifiers check the two paths agree). Only a bounded head and tail of a prompt are read,
so a 32k-token prompt costs what a 200-token one does (the instruction sits at either end).
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MODEL_FILE = "domain_model.npz"
METADATA_FILE = "metadata.json"

HEAD_CHARS = 384
TAIL_CHARS = 384

# Digits become 0 (numbers matter by shape, not value) and each ASCII symbol becomes a token of its
# own: symbols carry most of the code and math signal ("= =", "def x (", "$ 0"). One translate and
# one split run in C, several times faster than a regex tokenizer on the hot path.
_TOKENIZE_TABLE = str.maketrans(
    {**{symbol: f" {symbol} " for symbol in string.punctuation}, **{digit: "0" for digit in "123456789"}}
)


class ModelFileError(Exception):
    """A domain model directory is missing, unreadable or of another format version."""


def window(text: str) -> str:
    """The part of ``text`` the model reads: all of it when short, else its head and tail."""
    if len(text) <= HEAD_CHARS + TAIL_CHARS:
        return text
    return text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]


def analyze(text: str) -> list[str]:
    """Features of one text: lower-cased word/number/symbol tokens and their adjacent pairs."""
    tokens = window(text).lower().translate(_TOKENIZE_TABLE).split()
    return tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]


@dataclass(frozen=True, slots=True)
class DomainModel:
    """The exported linear model: vocabulary, idf weights, coefficients and class names."""

    classes: tuple[str, ...]
    vocabulary: dict[str, int]
    idf: np.ndarray  # (num_features,) float64
    coef: np.ndarray  # (num_features, num_classes) float64, transposed for row gathers
    intercept: np.ndarray  # (num_classes,)
    metadata: dict

    def scores(self, text: str) -> np.ndarray:
        """Decision scores per class (equal to the pipeline's ``decision_function``)."""
        ids = set(map(self.vocabulary.get, analyze(text)))
        ids.discard(None)
        if not ids:
            return self.intercept.copy()
        idx = np.fromiter(ids, dtype=np.intp, count=len(ids))
        weights = self.idf[idx]
        return (weights @ self.coef[idx]) * (1.0 / math.sqrt(weights @ weights)) + self.intercept

    def predict(self, text: str) -> tuple[str, float]:
        """The most likely domain and its probability (softmax of the scores)."""
        # nine floats: plain Python beats numpy's per-call overhead for the softmax
        scores = self.scores(text).tolist()
        top = max(scores)
        return self.classes[scores.index(top)], 1.0 / sum(math.exp(value - top) for value in scores)

    def predict_proba(self, text: str) -> np.ndarray:
        scores = self.scores(text)
        exp = np.exp(scores - scores.max())
        return exp / exp.sum()

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        terms = sorted(self.vocabulary, key=self.vocabulary.__getitem__)
        np.savez_compressed(
            out_dir / MODEL_FILE,
            terms=np.array(terms, dtype=np.str_),
            idf=self.idf.astype(np.float32),
            coef=self.coef.astype(np.float32),
            intercept=self.intercept,
            classes=np.array(self.classes, dtype=np.str_),
        )
        metadata = {**self.metadata, "format_version": FORMAT_VERSION, "classes": list(self.classes)}
        (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=1, sort_keys=True) + "\n")


def load_domain_model(model_dir: str | Path) -> DomainModel:
    """Load a model directory written by :meth:`DomainModel.save`; raise ModelFileError clearly."""
    model_dir = Path(model_dir)
    model_path, metadata_path = model_dir / MODEL_FILE, model_dir / METADATA_FILE
    for path in (model_path, metadata_path):
        if not path.is_file():
            raise ModelFileError(f"domain model file missing: {path} (train one with `polymorph classifiers train`)")
    try:
        metadata = json.loads(metadata_path.read_text())
        with np.load(model_path, allow_pickle=False) as arrays:
            terms, idf, coef = arrays["terms"], arrays["idf"], arrays["coef"]
            intercept, classes = arrays["intercept"], arrays["classes"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFileError(f"cannot read domain model in {model_dir}: {exc}") from exc
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ModelFileError(
            f"{metadata_path}: format_version {metadata.get('format_version')!r}, this Polymorph reads "
            f"{FORMAT_VERSION}; retrain with `polymorph classifiers train`"
        )
    if coef.shape != (len(terms), len(classes)) or idf.shape != (len(terms),):
        raise ModelFileError(f"{model_path}: inconsistent array shapes {coef.shape}, {idf.shape}")
    return DomainModel(
        classes=tuple(str(name) for name in classes),
        vocabulary={str(term): i for i, term in enumerate(terms)},
        idf=idf.astype(np.float64),
        coef=coef.astype(np.float64),
        intercept=intercept.astype(np.float64),
        metadata=metadata,
    )


def builtin_model_dir() -> Path:
    return Path(str(resources.files("classifiers") / "model"))


def load_builtin_domain_model() -> DomainModel:
    """The model shipped inside the package (classifiers/model/)."""
    return load_domain_model(builtin_model_dir())
