"""Labelled data: T0 leak groups, deduplication, and the two held-out splits."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from classifiers.datasets import (
    LABELLED_HERE,
    T0_TEST_DATASETS,
    Example,
    grouped_folds,
    labels_here,
    load_shared_examples,
    load_written_examples,
    split_cross_dataset,
)
from classifiers.shape import DOMAINS


def _t0_row(text: str, label: str, dataset: str, template: str, line: int) -> dict:
    return {"text": text, "label": label, "source": "t0_p3", "dataset": dataset, "template": template, "line": line}


def _write_sets(root: Path) -> None:
    (root / "t0").mkdir(parents=True)
    (root / "gsm8k").mkdir()
    rows = [
        # two templates of one dataset over the same passage (line 0): one leak group
        _t0_row("Summarize: the cat sat on the mat.", "summarization", "samsum", "samsum_Summarize_", 0),
        _t0_row("The cat sat on the mat. TL;DR:", "summarization", "samsum", "samsum_tldr", 0),
        _t0_row("The cat sat on the mat! tl;dr", "summarization", "samsum", "samsum_tldr", 1),  # same after normalising
        # a third template on other passages: its own group
        _t0_row("Write a dialogue for: a dog barks.", "creative_writing", "samsum", "samsum_Write_a_dialogue", 40),
        _t0_row("Storyline ideas for: a dog barks?", "brainstorming", "cnn_dailymail", "spice_up", 3),
        _t0_row("Storyline ideas for: a bird sings?", "brainstorming", "cnn_dailymail", "spice_up", 4),
    ]
    with gzip.open(root / "t0" / "prompts.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    gsm = [{"text": f"Tom has {n} apples. How many are left?", "label": "math"} for n in range(3)]
    (root / "gsm8k" / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in gsm))


def test_templates_sharing_a_passage_share_a_group_and_duplicates_are_dropped(tmp_path: Path) -> None:
    _write_sets(tmp_path)
    examples = load_shared_examples(tmp_path)
    by_text = {example.text: example for example in examples}
    assert "The cat sat on the mat! tl;dr" not in by_text  # a normalised duplicate of line 0's TL;DR row
    summarize, tldr = by_text["Summarize: the cat sat on the mat."], by_text["The cat sat on the mat. TL;DR:"]
    dialogue = by_text["Write a dialogue for: a dog barks."]
    assert summarize.group == tldr.group != dialogue.group
    assert summarize.dataset == "t0/samsum"
    # the single-template class is grouped by source line, so it can sit on both sides
    ideas = [example for example in examples if example.label == "brainstorming"]
    assert len({example.group for example in ideas}) == 2
    assert len({example.group for example in examples if example.label == "math"}) == 3


def test_sets_labelled_here_carry_a_known_domain_for_each_row_id() -> None:
    for set_name in LABELLED_HERE:
        labels = labels_here(set_name)
        assert len(labels) > 200
        assert set(labels.values()) == set(DOMAINS)  # every domain gets everyday-register rows


def test_prompts_written_here_are_ours_and_each_its_own_group() -> None:
    written = load_written_examples()
    assert {e.label for e in written} == {"math", "code", "chat", "brainstorming", "qa"} and all(e.labelled_here for e in written)
    assert len({e.group for e in written}) == len(written) == len({e.text for e in written})


def test_unlabelled_self_instruct_rows_take_the_labels_shipped_here(tmp_path: Path) -> None:
    _write_sets(tmp_path)
    (tmp_path / "self_instruct").mkdir()
    rows = [
        {"text": "Write an email inviting my friends to dinner.", "label": None, "id": "user_oriented_task_5", "motivation_app": "Gmail"},
        {"text": "Convert the given description to a bash command.", "label": None, "id": "user_oriented_task_190", "motivation_app": "GeeksforGeeks"},
        {"text": "Translate the article.", "label": None, "id": "user_oriented_task_100", "motivation_app": "Wikipedia"},  # left unlabelled
    ]
    (tmp_path / "self_instruct" / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = {e.text: e for e in load_shared_examples(tmp_path) if e.source == "self_instruct"}
    assert {text: e.label for text, e in found.items()} == {
        "Write an email inviting my friends to dinner.": "creative_writing",
        "Convert the given description to a bash command.": "code",
    }
    assert found["Write an email inviting my friends to dinner."].group == "self_instruct/Gmail"  # an app's tasks stay together
    assert all(e.labelled_here for e in found.values())


def test_alpaca_eval_rows_are_labelled_here_by_idx(tmp_path: Path) -> None:
    (tmp_path / "alpaca_eval").mkdir()
    rows = [
        {"text": "How did US states get their names?", "label": None, "dataset": "helpful_base", "idx": 1},
        {"text": "Can you tell my a story about nuclear physics like dr Seuss?", "label": None, "dataset": "koala", "idx": 134},
        {"text": "Solve for x in the equation 3x + 10 = 5(x - 2).", "label": None, "dataset": "vicuna", "idx": 793},
        {"text": "Given that f(x) = 5x^3 - 2x + 3, find the value of f(2).", "label": None, "dataset": "vicuna", "idx": 792},
    ]
    (tmp_path / "alpaca_eval" / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = {e.text[:12]: e for e in load_shared_examples(tmp_path)}
    assert [(e.label, e.labelled_here, e.dataset) for e in found.values()] == [
        ("qa", True, "alpaca_eval/helpful_base"),  # a factual question, not chat by its source any more
        ("creative_writing", True, "alpaca_eval/koala"),
        ("math", True, "alpaca_eval/vicuna"),
        ("math", True, "alpaca_eval/vicuna"),
    ]
    assert found["Solve for x "].group == found["Given that f"].group  # one block of Vicuna's templated questions


def _grid() -> list[Example]:
    labels = ("code", "math", "qa")
    return [Example(f"{label} prompt {g} {i}", label, f"{label}/{g}", "t", f"t0/set{g % 3}")
            for label in labels for g in range(8) for i in range(3)]


def test_grouped_folds_test_each_row_once_and_never_split_a_group() -> None:
    examples = _grid()
    tested: list[Example] = []
    for train, test in grouped_folds(examples, seed=1):
        assert not {e.group for e in train} & {e.group for e in test}
        assert {e.label for e in test} == {"code", "math", "qa"}  # stratified: every class in every fold
        tested.extend(test)
    assert sorted(tested, key=lambda e: e.text) == sorted(examples, key=lambda e: e.text)


def test_cross_dataset_split_holds_out_whole_t0_datasets() -> None:
    held = min(T0_TEST_DATASETS)
    examples = [Example(f"q {i}", "qa", f"g{i}", "t0", f"t0/{held}") for i in range(20)]
    examples += [Example(f"c {i}", "classification", f"h{i}", "t0", "t0/ag_news") for i in range(20)]
    train, test = split_cross_dataset(examples)
    assert {e.dataset for e in test} == {f"t0/{held}"} and {e.dataset for e in train} == {"t0/ag_news"}


def test_dataset_weights_even_out_datasets_within_a_class() -> None:
    from classifiers.train import dataset_weights

    examples = [Example(f"a{i}", "qa", f"a{i}", "t0", "t0/big") for i in range(30)]
    examples += [Example(f"b{i}", "qa", f"b{i}", "t0", "t0/small") for i in range(10)]
    examples += [Example(f"m{i}", "math", f"m{i}", "gsm8k", "gsm8k") for i in range(5)]
    weights = dataset_weights(examples)
    big, small, math = weights[:30].sum(), weights[30:40].sum(), weights[40:]
    assert big == pytest.approx(20.0) and small == pytest.approx(20.0)  # each dataset half of a 40-row class
    assert list(math) == [1.0] * 5
