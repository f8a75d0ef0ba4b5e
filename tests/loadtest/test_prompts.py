"""Prompts carry real text of their domain, the exact token count the gateway sees, and shared prefixes."""

from __future__ import annotations

import os

import pytest

from classifiers.shape import DOMAINS
from classifiers.tokens import count_chat_tokens, estimate_tokens
from loadtest.prompts import PromptSource, chat_overhead_tokens, corpus, cut_to_tokens
from loadtest.spec import HASH_BLOCK_TOKENS, RequestSpec


def _gateway_count(text: str) -> int:
    return count_chat_tokens([{"role": "user", "content": text}])


def test_every_domain_has_a_shipped_corpus() -> None:
    for domain in DOMAINS:
        prompts = corpus(domain)
        assert len(prompts) >= 30 and all(prompts)
    assert corpus("no-such-domain") == corpus("chat")


@pytest.mark.parametrize("num_tokens", [9, 10, 40, 333, 1024, 1400])
@pytest.mark.parametrize("domain", ["chat", "code", "math", "summarization"])
def test_prompt_has_exactly_the_target_count_the_gateway_sees(domain: str, num_tokens: int) -> None:
    source = PromptSource()
    for key in range(3):
        text = source.text_for(RequestSpec(0.0, num_tokens, 8, domain=domain), key=key)
        assert _gateway_count(text) == num_tokens


def test_long_prompts_land_within_a_fraction_of_a_percent() -> None:
    text = PromptSource().text_for(RequestSpec(0.0, 12_000, 8, domain="qa"), key=1)
    assert _gateway_count(text) == pytest.approx(12_000, rel=0.003)


def test_prompt_text_comes_from_the_domain_corpus() -> None:
    text = PromptSource().text_for(RequestSpec(0.0, 200, 8, domain="math"), key=2)
    assert text.split("\n\n")[0] == corpus("math")[2][: len(text.split("\n\n")[0])]


def test_same_key_same_text_and_different_keys_differ() -> None:
    source = PromptSource()
    spec = RequestSpec(0.0, 300, 8, domain="code")
    assert source.text_for(spec, key=5) == PromptSource().text_for(spec, key=5)
    assert source.text_for(spec, key=5) != source.text_for(spec, key=6)


def test_equal_leading_hash_ids_share_a_text_prefix_and_others_do_not() -> None:
    source = PromptSource()
    a = source.text_for(RequestSpec(0.0, 1500, 8, hash_ids=(1, 2, 3)), key=0)
    b = source.text_for(RequestSpec(0.0, 1400, 8, hash_ids=(1, 2, 4)), key=1)
    c = source.text_for(RequestSpec(0.0, 1400, 8, hash_ids=(9, 2, 3)), key=2)
    shared = os.path.commonprefix([a, b])
    assert estimate_tokens(shared) >= 2 * HASH_BLOCK_TOKENS - 2
    assert estimate_tokens(os.path.commonprefix([a, c])) < 20
    assert _gateway_count(a) == 1500 and _gateway_count(b) == 1400
    # ids that land on the same corpus prompt still read differently: a prefix cache that hashes the
    # text (a router that drops hash_ids) must not find a shared prefix the ids deny
    again = 1 + len(corpus("chat"))
    d = source.text_for(RequestSpec(0.0, 1400, 8, hash_ids=(again, 2, 3)), key=3)
    assert estimate_tokens(os.path.commonprefix([a, d])) < 20


def test_a_spec_with_text_is_sent_verbatim() -> None:
    assert PromptSource().text_for(RequestSpec(0.0, 50, 8, text="hello there"), key=0) == "hello there"


def test_cut_to_tokens_edges() -> None:
    assert cut_to_tokens("short text", 0) == ""
    assert cut_to_tokens("short text", 100) == "short text"
    assert chat_overhead_tokens() == _gateway_count("")
