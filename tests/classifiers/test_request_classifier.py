"""RequestClassifier: features, shapes from config rules, odd bodies, load errors, learning."""

from __future__ import annotations

from pathlib import Path

import pytest

from classifiers.config import ClassifierConfigError, rules_from_mapping
from classifiers.prefix import PREFIX_FP_CHARS, prefix_fingerprint
from classifiers.request import ClassifierLoadError, RequestClassifier
from classifiers.shape import Shape

MATH = "Tom has 12 apples and gives a third of them to Ann. She eats 2. How many apples does Ann have left?"


@pytest.fixture(scope="module")
def classifier() -> RequestClassifier:
    return RequestClassifier.load()


def _chat(text: str, system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return {"model": "m", "messages": messages, **extra}


def test_features_are_extracted(classifier) -> None:
    body = _chat(MATH, system="You are a tutor.", max_tokens=300, stream=True,
                 tools=[{"type": "function", "function": {"name": "calc"}}], response_format={"type": "json_object"})
    shape = classifier.classify(body, chat=True, tenant="acme", tier="interactive")
    assert isinstance(shape, Shape)
    assert (shape.domain, shape.tier, shape.tenant, shape.num_messages) == ("math", "interactive", "acme", 2)
    assert shape.stream and shape.has_tools and shape.json_mode and shape.max_tokens == 300
    assert shape.predicted_output_p90 <= 300 and shape.prompt_tokens > 25
    same_system = classifier.classify(_chat("hello", system="You are a tutor."), chat=True, tenant="x", tier="batch")
    assert shape.prefix_fp == same_system.prefix_fp != 0
    assert classifier.classify(_chat("hello"), chat=True, tenant="x", tier="batch").prefix_fp == 0


def test_shapes_follow_config_rules_in_order() -> None:
    rules = rules_from_mapping({
        "shapes": [
            {"name": "vip", "tenants": ["vip"]},
            {"name": "long", "min_prompt_tokens": 2000},
            {"name": "mathy", "domains": ["math"]},
        ],
        "default_shape": "other",
    })
    classifier = RequestClassifier.load(rules=rules)
    assert classifier.classify(_chat(MATH), chat=True, tenant="vip", tier="standard").name == "vip"
    assert classifier.classify(_chat(MATH * 100), chat=True, tenant="t", tier="standard").name == "long"
    assert classifier.classify(_chat(MATH), chat=True, tenant="t", tier="standard").name == "mathy"
    assert classifier.classify({"prompt": "Write a poem about rain"}, chat=False, tenant="t", tier="standard").name \
        == "other"


def test_default_rules_route_batch_and_long_context(classifier) -> None:
    assert classifier.classify(_chat("hi"), chat=True, tenant="t", tier="batch").name == "batch"
    assert classifier.classify(_chat("word " * 6000), chat=True, tenant="t", tier="standard").name == "long-context"


def test_bad_rules_are_rejected() -> None:
    with pytest.raises(ClassifierConfigError, match="is not one of"):
        rules_from_mapping({"shapes": [{"name": "x", "domains": ["poetry"]}]})
    with pytest.raises(ClassifierConfigError, match="non-negative"):
        rules_from_mapping({"shapes": [{"name": "x", "min_prompt_tokens": -1}]})


@pytest.mark.parametrize("body, chat", [
    ({"messages": []}, True),
    ({"messages": [{"role": "user", "content": None}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, True),
    ({"prompt": [1, 2, 3]}, False),
    ({"prompt": [[1, 2], [3]]}, False),
    ({"prompt": ["a", "b"]}, False),
    ({"prompt": ""}, False),
    ({}, False),
])
def test_validated_but_unusual_bodies_do_not_raise(classifier, body, chat) -> None:
    shape = classifier.classify(body, chat=chat, tenant="t", tier="standard")
    assert shape.prompt_tokens >= 0 and shape.predicted_output_p50 >= 1


def test_token_id_prompts_count_exactly(classifier) -> None:
    assert classifier.classify({"prompt": list(range(77))}, chat=False, tenant="t", tier="s").prompt_tokens == 77


def test_long_inputs_are_read_through_bounded_windows(classifier) -> None:
    system = "You answer questions about the attached manual. " * 200
    same_head = system[:PREFIX_FP_CHARS] + "A different ending."
    assert prefix_fingerprint([{"role": "system", "content": system}]) == prefix_fingerprint(
        [{"role": "system", "content": same_head}]) != prefix_fingerprint([{"role": "system", "content": "Other."}])
    parts = [MATH, "filler words here. " * 3000, MATH]
    as_parts = classifier.classify({"messages": [{"role": "user", "content": [{"type": "text", "text": p} for p in parts]}]},
                                   chat=True, tenant="t", tier="s")
    joined = classifier.classify(_chat("\n".join(parts)), chat=True, tenant="t", tier="s")
    assert (as_parts.domain, as_parts.domain_confidence) == (joined.domain, joined.domain_confidence)
    assert as_parts.prompt_tokens == pytest.approx(joined.prompt_tokens, rel=0.01)
    completion = classifier.classify({"prompt": parts}, chat=False, tenant="t", tier="s")
    assert completion.domain == joined.domain and completion.prompt_tokens == pytest.approx(joined.prompt_tokens, rel=0.01)


def test_observe_moves_the_prediction(classifier) -> None:
    local = RequestClassifier.load()
    shape = local.classify(_chat(MATH), chat=True, tenant="learn", tier="standard")
    for _ in range(200):
        local.observe(shape, 20)
    assert local.classify(_chat(MATH), chat=True, tenant="learn", tier="standard").predicted_output_p50 <= 25


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ClassifierLoadError, match="classifier.model"):
        RequestClassifier.load(str(tmp_path))
    with pytest.raises(ClassifierLoadError, match="classifier.tokenizer"):
        RequestClassifier.load(tokenizer=str(tmp_path / "none.json"))
