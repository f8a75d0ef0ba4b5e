"""Token counting: the estimate, chat template overhead, and exact counts from a tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from classifiers.tokens import (
    BOS_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMER_TOKENS,
    ExactTokenCounter,
    count_chat_tokens,
    estimate_tokens,
)


def test_estimate_is_near_known_bpe_counts() -> None:
    # cl100k_base counts of these texts, measured once with the bpe-openai package
    known = {
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.": 23,
        "Write a function to find the minimum cost path to reach (m, n) from (0, 0) for the given matrix.": 25,
    }
    for text, count in known.items():
        assert abs(estimate_tokens(text) - count) <= 0.15 * count


def test_estimate_of_long_text_uses_windows_and_scales() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4000
    short = "The quick brown fox jumps over the lazy dog. " * 40
    assert estimate_tokens("") == 0
    assert estimate_tokens("x") == 1
    assert estimate_tokens(text) == pytest.approx(100 * estimate_tokens(short), rel=0.02)


def test_chat_template_overhead_is_counted() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text_tokens = estimate_tokens("Be brief.") + estimate_tokens("Hello there")
    overhead = BOS_TOKENS + REPLY_PRIMER_TOKENS + 2 * MESSAGE_OVERHEAD_TOKENS
    assert count_chat_tokens(messages) == text_tokens + overhead
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    assert count_chat_tokens(parts) == estimate_tokens("Hello there") + BOS_TOKENS + REPLY_PRIMER_TOKENS + 4


def _tiny_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["hello world, hello tokens"] * 20, trainers.BpeTrainer(vocab_size=300))
    out = path / "tokenizer.json"
    tokenizer.save(str(out))
    return out


def test_exact_counter_counts_with_a_tokenizer_file(tmp_path: Path) -> None:
    counter = ExactTokenCounter(_tiny_tokenizer(tmp_path))
    assert counter.count("") == 0
    assert 1 <= counter.count("hello world") <= 4
    assert count_chat_tokens([{"role": "user", "content": "hello"}], counter.count) == counter.count("hello") + 8


def test_exact_counter_rejects_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ExactTokenCounter(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        ExactTokenCounter(bad)
