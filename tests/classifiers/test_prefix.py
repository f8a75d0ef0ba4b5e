"""Prefix fingerprints: a system prompt, else a conversation's history; a lone message has none."""

from __future__ import annotations

from classifiers.prefix import HEAD_FP_CHARS, prefix_fingerprint

DOCUMENT = "The lease runs for five years and renews unless either party objects in writing. " * 30  # ~2.4 kB


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _reply(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_a_conversation_without_a_system_prompt_keeps_one_fingerprint_from_its_second_turn() -> None:
    first = [_user("Hi! Can you help me plan a trip to Lisbon?")]
    second = [*first, _reply("Of course. " + "Here is a day-by-day plan. " * 60), _user("Make day two cheaper.")]
    third = [*second, _reply("Day two, cheaper: walk, then a tram."), _user("And day three?")]
    assert prefix_fingerprint(first) == 0  # a lone message: template or one-off, nobody can tell; placed by load
    assert prefix_fingerprint(second) == prefix_fingerprint(third) != 0
    other = [_user("Hi! Can you help me plan a trip to Porto?"), *second[1:]]
    assert prefix_fingerprint(other) not in (0, prefix_fingerprint(second))


def test_a_lone_message_or_a_short_history_has_no_fingerprint() -> None:
    assert prefix_fingerprint([_user(DOCUMENT)]) == 0
    short = [_user("Hi."), _reply("Hello!"), _user("How are you?")]
    assert sum(len(m["content"]) for m in short) < HEAD_FP_CHARS and prefix_fingerprint(short) == 0
    as_parts = [{"role": "user", "content": [{"type": "text", "text": DOCUMENT[:500]}, {"type": "image_url"}, {"type": "text", "text": DOCUMENT[500:]}]},
                _reply("Noted."), _user("Who pays?")]
    assert prefix_fingerprint(as_parts) == prefix_fingerprint([_user(DOCUMENT), _reply("Noted."), _user("Who pays?")]) != 0  # same text, in parts


def test_a_system_prompt_is_the_shared_prefix_whatever_follows_and_an_empty_one_is_none() -> None:
    system = {"role": "system", "content": "You are a careful legal assistant."}
    assert prefix_fingerprint([system, _user("Hello.")]) == prefix_fingerprint([system, _user(DOCUMENT), _reply("ok"), _user("?")]) != 0
    developer = {"role": "developer", "content": "You are a careful legal assistant."}
    assert prefix_fingerprint([developer, _user("Hello.")]) == prefix_fingerprint([system, _user("Hi.")])
    empty = {"role": "system", "content": ""}
    history = [_user(DOCUMENT), _reply("ok"), _user("Who pays?")]
    assert prefix_fingerprint([empty, *history]) == prefix_fingerprint(history) != 0
    assert prefix_fingerprint([empty, _user(DOCUMENT)]) == 0
