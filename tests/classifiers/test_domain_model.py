"""The domain model: known prompts, agreement of the scikit-learn and fast paths, model files."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from classifiers.datasets import Example
from classifiers.domain import (
    MAX_FEATURES_PER_PROMPT,
    DomainModel,
    ModelFileError,
    builtin_model_dir,
    load_builtin_domain_model,
    load_domain_model,
    window,
    window_of_parts,
)
from classifiers.train import export_pipeline, fit_pipeline

KNOWN = {
    "code": [
        "Write a Python function that returns the longest palindromic substring of a string.",
        "Write a function to sort a list of tuples by the second element.\nassert f([(1, 2)]) == [(1, 2)]",
    ],
    "math": [
        "A train travels 60 miles per hour for 3 hours, then 40 miles per hour for 2 hours. How far did it go?",
        "Tom has 12 apples and gives a third of them to Ann. She eats 2. How many apples does Ann have left?",
        "Solve 3x + 5 = 20 for x.",  # symbolic: GSM8K has none, and MBPP's symbols made it code
    ],
    # "Write a ..." is MBPP's phrasing: these were code (0.98 for the haiku) before the hand-labelled
    # Self-Instruct rows taught the everyday register
    "creative_writing": ["Write a haiku about GPUs.", "Write an email to my boss asking for a day off."],
    "brainstorming": ["Suggest some names for my new coffee shop."],
}


@pytest.fixture(scope="module")
def model():
    return load_builtin_domain_model()


def test_known_prompts_land_in_their_domain(model) -> None:
    for domain, prompts in KNOWN.items():
        for prompt in prompts:
            assert model.predict(prompt)[0] == domain, prompt


def test_a_code_block_without_task_text_is_code(model) -> None:
    # MBPP is task text + asserts; the Open Assistant and Koala rows labelled here carry code bodies
    assert model.predict("Fix the bug in this code:\n```python\ndef add(a, b):\n    return a - b\n```")[0] == "code"


def test_confidence_is_a_probability_and_long_prompts_are_windowed(model) -> None:
    _, confidence = model.predict(KNOWN["math"][0])
    assert 0.0 < confidence <= 1.0
    long_text = KNOWN["code"][0] + " lorem ipsum dolor" * 20000 + " " + KNOWN["code"][0]
    assert model.predict(long_text)[0] == "code"
    assert model.predict("")[0] in model.classes


def test_shipped_metadata_carries_version_digest_and_both_splits_scores(model) -> None:
    meta = model.metadata
    assert meta["model_version"] and len(meta["training_data_sha256"]) == 64
    for split in ("grouped_cv", "cross_dataset"):
        assert set(meta["held_out_scores"][split]["per_class_f1"]) == set(model.classes)
    assert meta["held_out_scores"]["calibration"]["temperature"] == pytest.approx(model.temperature, rel=1e-3)
    assert meta["attribution"]
    assert sum(f.stat().st_size for f in builtin_model_dir().iterdir()) < 4 * 2**20


def test_window_of_parts_equals_the_window_of_the_joined_text() -> None:
    for parts in (["short", "parts"], ["x" * 1000], ["a" * 383, "b" * 2, "c" * 5000, "d"], ["", "e" * 900, ""],
                  ["f" * 384, "g" * 384], ["h" * 200] * 10):
        assert window_of_parts(parts) == window("\n".join(parts))


TINY = [
    Example("write a python function to reverse a list", "code", "c1", "t"),
    Example("def f(x): return x + 1  # fix this function", "code", "c2", "t"),
    Example("implement a function that sorts an array in place", "code", "c3", "t"),
    Example("how many apples does she have left if she eats 3 of 12", "math", "m1", "t"),
    Example("a car drives 40 miles per hour for 2 hours how far", "math", "m2", "t"),
    Example("john has 5 dollars and spends 2 how many dollars remain", "math", "m3", "t"),
    Example("summarize the following article in two sentences", "summarization", "s1", "t"),
    Example("give a short summary of this text tl;dr", "summarization", "s2", "t"),
    Example("write a brief summary of the passage below", "summarization", "s3", "t"),
]


def test_sklearn_and_fast_paths_agree() -> None:
    examples = TINY * 2  # min_df=2 needs each term twice
    pipeline = fit_pipeline(examples)
    fast = export_pipeline(pipeline, {})
    every_term = " ".join(e.text for e in TINY)
    probes = [e.text for e in TINY] + ["an unseen prompt with no known words zzz", "", "how many dollars per hour",
                                       every_term]
    expected = pipeline.decision_function(probes)
    for probe, row in zip(probes, expected):
        assert np.allclose(fast.scores(probe), row, atol=1e-9)
        assert fast.predict(probe)[0] == pipeline.predict([probe])[0]
        assert np.allclose(fast.predict_proba(probe), pipeline.predict_proba([probe])[0], atol=1e-9)
    # a temperature rescales confidence only: same domain, softmax(scores / T)
    warm = replace(fast, temperature=2.5)
    for probe, row in zip(probes, expected):
        domain, confidence = warm.predict(probe)
        softmax = np.exp(row / 2.5 - (row / 2.5).max())
        assert domain == fast.predict(probe)[0] and confidence == pytest.approx(softmax.max() / softmax.sum())


def test_packed_row_sums_hold_a_full_window_of_extreme_weights() -> None:
    # every feature of a window full of distinct words and pairs carries the largest weight, of
    # one sign per class: the fixed-point fields must add up without overflowing into each other
    words = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefgh"][:200]  # digits would all read 0
    terms = words + [f"{a} {b}" for a, b in pairwise(words)]
    rng = np.random.default_rng(0)
    coef = np.where(np.arange(4) % 2 == 0, 1.0, -1.0)[None, :] * rng.uniform(0.999, 1.0, (len(terms), 4))
    model = DomainModel(("a", "b", "c", "d"), {t: i for i, t in enumerate(terms)}, np.full(len(terms), 9.0),
                        coef * 50.0, np.array([0.1, -0.2, 0.3, 0.0]), {})
    text = " ".join(words)
    ids = sorted(model._feature_set(text))
    assert len(ids) == len(terms)  # 599 characters: the whole text is the window
    weighted = model.coef[ids] * model.idf[ids, None]
    expected = weighted.sum(axis=0) / np.sqrt((model.idf[ids] ** 2).sum()) + model.intercept
    assert np.allclose(model.scores(text), expected, rtol=0, atol=1e-9)
    assert len(ids) <= MAX_FEATURES_PER_PROMPT


def test_a_model_round_trips_through_its_files(tmp_path: Path) -> None:
    fast = replace(export_pipeline(fit_pipeline(TINY * 2), {"note": "x"}), temperature=1.7)
    fast.save(tmp_path)
    loaded = load_domain_model(tmp_path)
    assert loaded.temperature == pytest.approx(1.7) and loaded.metadata["note"] == "x"
    for example in TINY:
        assert np.allclose(loaded.scores(example.text), fast.scores(example.text), atol=1e-5)  # float32 on disk


def test_missing_and_incompatible_model_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="missing"):
        load_domain_model(tmp_path)
    copy = tmp_path / "model"
    shutil.copytree(builtin_model_dir(), copy)
    meta = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**meta, "format_version": 999}))
    with pytest.raises(ModelFileError, match="format_version"):
        load_domain_model(copy)
    (copy / "domain_model.npz").write_bytes(b"not a zip")
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFileError, match="cannot read"):
        load_domain_model(copy)
