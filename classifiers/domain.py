"""Domain of a prompt: word and bigram features, a linear model, and a lean inference path.

Training builds a scikit-learn pipeline (``TfidfVectorizer`` over :func:`analyze`, then a
multinomial ``LogisticRegression``). Serving does not call scikit-learn: the vocabulary is a dict
keyed by a word or a (word, word) pair, so a prompt's features are C-level ``map`` look-ups with no
bigram strings built, and its scores a sum of idf-scaled weight rows: in plain Python for the few
dozen features of a short prompt (numpy's per-call overhead would dominate), one numpy gather and
reduce above that. Both give the numbers scikit-learn computes (tests/classifiers check the paths
agree). Only a bounded head and tail of a prompt are read, so a 32k-token prompt costs what a
200-token one does (the instruction sits at either end).
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MODEL_FILE = "domain_model.npz"
METADATA_FILE = "metadata.json"

HEAD_CHARS = 384
TAIL_CHARS = 384
# Above this many distinct features one numpy gather+reduce beats summing Python tuples.
MAX_PYTHON_SUM_FEATURES = 48

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
    # Serving tables derived from the fields above (__post_init__).
    _feature_ids: dict[str | tuple[str, str], int] = field(init=False, repr=False, compare=False)
    _rows: list[tuple[float, ...]] = field(init=False, repr=False, compare=False)  # idf*coef, then idf**2
    _table: np.ndarray = field(init=False, repr=False, compare=False)  # the same rows as one array
    _intercept: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # bigram terms are "a b" and tokens never hold a space: key them by the pair analyze zips
        feature_ids = {tuple(term.split(" ")) if " " in term else term: i for term, i in self.vocabulary.items()}
        table = np.ascontiguousarray(np.hstack([self.coef * self.idf[:, None], (self.idf**2)[:, None]]))
        object.__setattr__(self, "_feature_ids", feature_ids)
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_rows", [tuple(row) for row in table.tolist()])
        object.__setattr__(self, "_intercept", tuple(self.intercept.tolist()))

    def _feature_set(self, text: str) -> set[int]:
        """Ids of the features of ``text`` (the same terms as :func:`analyze`, deduplicated: tf is binary)."""
        tokens = window(text).lower().translate(_TOKENIZE_TABLE).split()
        get = self._feature_ids.get
        ids = set(map(get, tokens))
        ids.update(map(get, zip(tokens, tokens[1:])))
        ids.discard(None)
        return ids  # type: ignore[return-value]

    def _score_list(self, text: str) -> list[float]:
        ids = self._feature_set(text)
        if not ids:
            return list(self._intercept)
        if len(ids) <= MAX_PYTHON_SUM_FEATURES:
            sums = list(map(sum, zip(*map(self._rows.__getitem__, ids))))
        else:
            sums = self._table[np.fromiter(ids, dtype=np.intp, count=len(ids))].sum(axis=0).tolist()
        norm = 1.0 / math.sqrt(sums.pop())  # l2 norm of the tf-idf vector (binary tf: sqrt of idf**2 sum)
        return [total * norm + bias for total, bias in zip(sums, self._intercept)]

    def scores(self, text: str) -> np.ndarray:
        """Decision scores per class (equal to the pipeline's ``decision_function``)."""
        return np.asarray(self._score_list(text))

    def predict(self, text: str) -> tuple[str, float]:
        """The most likely domain and its probability (softmax of the scores)."""
        scores = self._score_list(text)  # nine floats: plain Python beats numpy for the softmax
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
