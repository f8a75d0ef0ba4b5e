"""Domain of a prompt: word and bigram features, a linear model, and a lean inference path.

Training builds a scikit-learn pipeline (``TfidfVectorizer`` over :func:`analyze`, then a
multinomial ``LogisticRegression``). Serving does not call scikit-learn: a prompt's bounded head
and tail window is tokenized in C (one UTF-8 encode, one ``bytes.translate``, one regex
``findall``) and the vocabulary is a dict keyed by a token or a (token, token) pair, so a prompt's
features are two C-level ``map(dict.get, ...)`` passes with no bigram strings built. Scores sum
idf-scaled weight rows, each row one Python int packing its values as 64-bit fixed-point fields:
one C-level ``sum`` adds whole rows and one ``struct`` unpack splits the total (a numpy gather and
reduce, or ten float objects per row, cost more at every feature count a window can hold). The
scores are scikit-learn's to ~1e-11 (tests/classifiers check). A 32k-token prompt costs what a
short one with a full window does: nothing before the window reads more than the window.
"""

from __future__ import annotations

import json
import math
import re
import string
import struct
from dataclasses import dataclass, field
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 2  # 2: byte tokens (ASCII lower-case), temperature
MODEL_FILE = "domain_model.npz"
METADATA_FILE = "metadata.json"

HEAD_CHARS = 384
TAIL_CHARS = 384
# A window has at most HEAD_CHARS + TAIL_CHARS + 1 tokens (each holds a character at least), so a
# prompt has at most twice that many distinct features (tokens and adjacent pairs).
MAX_FEATURES_PER_PROMPT = 2 * (HEAD_CHARS + TAIL_CHARS + 1)
# A packed row field holds offset + value x scale in 64 bits (scale: |value x scale| <= offset / 2).
# The offset keeps every field non-negative, so fields add without borrowing; each stays below
# 1.5 x offset, so a sum of MAX_FEATURES_PER_PROMPT rows fits its 64 bits.
_FIELD_OFFSET = 1 << 52
assert MAX_FEATURES_PER_PROMPT * 3 * _FIELD_OFFSET // 2 < 1 << 64

# One bytes.translate lower-cases ASCII and maps digits to 0 (numbers matter by shape, not value).
_BYTE_TABLE = bytes.maketrans(
    string.ascii_uppercase.encode() + b"123456789", string.ascii_lowercase.encode() + b"0" * 9
)
# A token is a run of anything but whitespace and ASCII punctuation, or one ASCII symbol: symbols
# carry most of the code and math signal ("= =", "def x (", "$ 0"). Non-ASCII bytes stay inside words.
_PUNCT = re.escape(string.punctuation.encode())
_TOKEN_RE = re.compile(rb"[^\s" + _PUNCT + rb"]+|[" + _PUNCT + rb"]")


class ModelFileError(Exception):
    """A domain model directory is missing, unreadable or of another format version."""


def window(text: str) -> str:
    """The part of ``text`` the model reads: all of it when short, else its head and tail."""
    if len(text) <= HEAD_CHARS + TAIL_CHARS:
        return text
    return text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]


def window_of_parts(parts: list[str]) -> str:
    """``window("\\n".join(parts))`` without joining the parts: only the pieces the window keeps are copied."""
    if sum(map(len, parts)) + len(parts) - 1 <= HEAD_CHARS + TAIL_CHARS:
        return "\n".join(parts)
    head: list[str] = []
    budget = HEAD_CHARS
    for part in parts:
        head.append(part[:budget])
        budget -= len(head[-1]) + 1
        if budget < 0:
            break
    tail: list[str] = []
    budget = TAIL_CHARS
    for part in reversed(parts):
        tail.append(part[-budget:] if budget else "")
        budget -= len(tail[-1]) + 1
        if budget < 0:
            break
    return "\n".join(head)[:HEAD_CHARS] + "\n" + "\n".join(reversed(tail))[-TAIL_CHARS:]


def tokenize(text: str) -> list[bytes]:
    """Tokens of the window of ``text``: ASCII-lower-cased words/numbers (digits as 0) and single symbols."""
    return _TOKEN_RE.findall(window(text).encode("utf-8", "surrogatepass").translate(_BYTE_TABLE))


def analyze(text: str) -> list[str]:
    """Features of one text (training): its tokens and their adjacent pairs, as strings."""
    tokens = [token.decode("utf-8", "surrogatepass") for token in tokenize(text)]
    return tokens + [f"{a} {b}" for a, b in pairwise(tokens)]


@dataclass(frozen=True, slots=True)
class DomainModel:
    """The exported linear model: vocabulary, idf weights, coefficients and class names."""

    classes: tuple[str, ...]
    vocabulary: dict[str, int]
    idf: np.ndarray  # (num_features,) float64
    coef: np.ndarray  # (num_features, num_classes) float64, transposed for row gathers
    intercept: np.ndarray  # (num_classes,)
    metadata: dict[str, Any]
    temperature: float = 1.0  # confidence = softmax(scores / temperature), fitted on held-out rows
    # Serving tables derived from the fields above (__post_init__).
    _feature_ids: dict[bytes | tuple[bytes, bytes], int] = field(init=False, repr=False, compare=False)
    _packed_rows: list[int] = field(init=False, repr=False, compare=False)  # idf*coef, then idf**2: fixed-point fields
    _row_scale: float = field(init=False, repr=False, compare=False)  # a field's value x this is the row's value
    _unpack_row: struct.Struct = field(init=False, repr=False, compare=False)
    _intercept: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # bigram terms are "a b" and tokens never hold a space: key them by the pair pairwise() yields
        feature_ids = {
            tuple(part.encode("utf-8", "surrogatepass") for part in term.split(" ")) if " " in term
            else term.encode("utf-8", "surrogatepass"): i
            for term, i in self.vocabulary.items()
        }
        table = np.ascontiguousarray(np.hstack([self.coef * self.idf[:, None], (self.idf**2)[:, None]]))
        # The largest power-of-two scale that keeps every |value| x scale within half the offset.
        largest = float(np.abs(table).max()) if table.size else 1.0
        scale = 2.0 ** (math.floor(math.log2(_FIELD_OFFSET / largest)) - 1) if largest > 0 else 1.0
        fields = (np.rint(table * scale).astype(np.int64) + _FIELD_OFFSET).astype("<u8")
        object.__setattr__(self, "_feature_ids", feature_ids)
        object.__setattr__(self, "_packed_rows", [int.from_bytes(row.tobytes(), "little") for row in fields])
        object.__setattr__(self, "_row_scale", 1.0 / scale)
        object.__setattr__(self, "_unpack_row", struct.Struct(f"<{table.shape[1]}Q"))
        object.__setattr__(self, "_intercept", tuple(self.intercept.tolist()))

    def _feature_set(self, text: str) -> set[int]:
        """Ids of the features of ``text`` (the terms of :func:`analyze`, deduplicated: tf is binary)."""
        tokens = tokenize(text)
        get = self._feature_ids.get
        ids = set(map(get, tokens))
        ids.update(map(get, pairwise(tokens)))
        ids.discard(None)
        return ids  # type: ignore[return-value]

    def _score_list(self, text: str) -> list[float]:
        ids = self._feature_set(text)
        if not ids:
            return list(self._intercept)
        packed = sum(map(self._packed_rows.__getitem__, ids))
        offset, scale = len(ids) * _FIELD_OFFSET, self._row_scale
        sums = [(total - offset) * scale for total in self._unpack_row.unpack(packed.to_bytes(self._unpack_row.size, "little"))]
        norm = 1.0 / math.sqrt(sums.pop())  # l2 norm of the tf-idf vector (binary tf: sqrt of idf**2 sum)
        return [total * norm + bias for total, bias in zip(sums, self._intercept)]

    def scores(self, text: str) -> np.ndarray:
        """Decision scores per class (equal to the pipeline's ``decision_function``)."""
        return np.asarray(self._score_list(text))

    def predict(self, text: str) -> tuple[str, float]:
        """The most likely domain and its calibrated probability (softmax of scores / temperature)."""
        scores = self._score_list(text)  # nine floats: plain Python beats numpy for the softmax
        top = max(scores)
        inverse_t = 1.0 / self.temperature
        return self.classes[scores.index(top)], 1.0 / sum(math.exp((value - top) * inverse_t) for value in scores)

    def predict_proba(self, text: str) -> np.ndarray:
        scores = self.scores(text) / self.temperature
        exp = np.exp(scores - scores.max())
        proba: np.ndarray = exp / exp.sum()
        return proba

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
            temperature=np.float64(self.temperature),
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
            temperature = float(arrays["temperature"])
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
        temperature=temperature,
    )


def builtin_model_dir() -> Path:
    return Path(str(resources.files("classifiers") / "model"))


def load_builtin_domain_model() -> DomainModel:
    """The model shipped inside the package (classifiers/model/)."""
    return load_domain_model(builtin_model_dir())
