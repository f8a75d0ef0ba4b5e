"""Prompt token counts: a tokenizer-free estimate for the hot path, exact counts when configured.

The estimate is a linear model over character classes that C-level ``str`` methods count in one
pass each (no Python loop over characters). It was fitted against a real byte-level BPE tokenizer (OpenAI cl100k_base)
on the shared prompt sets; README.md reports its error. Texts longer than a few KiB are estimated
from three bounded windows (head, middle, tail) scaled to the full length, so the cost stays
constant however long the prompt is.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Coefficients of: tokens ~ c0*chars + c1*spaces + c2*newlines + c3*non_ascii_bytes + c4*digits
# + c5*punctuation. Fitted by ``classifiers.tokens_fit`` (see README); refit there, not by hand.
_C_CHARS = 0.0612
_C_SPACES = 0.7508
_C_NEWLINES = 0.3777
_C_NON_ASCII_BYTES = 0.401
_C_DIGITS = 0.6232
_C_PUNCT = 0.7842

_MAX_EXACT_CHARS = 6144  # above this, estimate from windows
_WINDOW_CHARS = 2048

# Chat template overhead (Llama-3 / ChatML style): each message carries a header
# (start token, role, separator) and an end token; the prompt ends with the assistant header.
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMER_TOKENS = 3
BOS_TOKENS = 1
IMAGE_PART_TOKENS = 576  # a typical ViT patch budget for one image; text-only engines reject them anyway

_DIGIT_BYTES = b"0123456789"
_PUNCT_BYTES = string.punctuation.encode()


def _window_features(text: str) -> tuple[int, int, int, int, int, int]:
    # bytes.translate with a delete set is a table lookup per byte in C: far cheaper than str.translate
    data = text.encode("utf-8", "surrogatepass")
    num_chars, num_bytes = len(text), len(data)
    num_digits = num_bytes - len(data.translate(None, _DIGIT_BYTES))
    num_punct = num_bytes - len(data.translate(None, _PUNCT_BYTES))
    return num_chars, data.count(b" "), data.count(b"\n"), num_bytes - num_chars, num_digits, num_punct


def _estimate_window(text: str) -> float:
    num_chars, num_spaces, num_newlines, num_non_ascii, num_digits, num_punct = _window_features(text)
    return (
        _C_CHARS * num_chars
        + _C_SPACES * num_spaces
        + _C_NEWLINES * num_newlines
        + _C_NON_ASCII_BYTES * num_non_ascii
        + _C_DIGITS * num_digits
        + _C_PUNCT * num_punct
    )


def estimate_tokens(text: str) -> int:
    """Tokens a byte-level BPE tokenizer would give ``text``, estimated without one (>= 1 if non-empty)."""
    num_chars = len(text)
    if num_chars == 0:
        return 0
    if num_chars <= _MAX_EXACT_CHARS:
        return max(1, round(_estimate_window(text)))
    mid = (num_chars - _WINDOW_CHARS) // 2
    sampled = (
        _estimate_window(text[:_WINDOW_CHARS])
        + _estimate_window(text[mid : mid + _WINDOW_CHARS])
        + _estimate_window(text[-_WINDOW_CHARS:])
    )
    return max(1, round(sampled * num_chars / (3 * _WINDOW_CHARS)))


def content_parts(content: Any) -> tuple[list[str], int]:
    """The text parts of an OpenAI message ``content`` (str or list of parts) and the count of other parts."""
    if isinstance(content, str):
        return [content], 0
    if not isinstance(content, list):
        return [], 0
    texts: list[str] = []
    num_other_parts = 0
    for part in content:
        if isinstance(part, Mapping):
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
                continue
        elif isinstance(part, str):
            texts.append(part)
            continue
        num_other_parts += 1
    return texts, num_other_parts


def content_text(content: Any) -> tuple[str, int]:
    """The text of a message ``content`` (its text parts joined by newlines) and the count of other parts."""
    if isinstance(content, str):
        return content, 0
    texts, num_other_parts = content_parts(content)
    return "\n".join(texts), num_other_parts


def count_chat_tokens(messages: Iterable[Mapping[str, Any]], count_text: Any = estimate_tokens) -> int:
    """Prompt tokens of a chat request after the chat template is applied.

    ``count_text`` maps a string to its token count: the estimate by default, or an exact
    tokenizer's count (``ExactTokenCounter.count``). Text parts are counted one by one, so a long
    multi-part message is never joined into one string (the estimate of each is bounded).
    """
    total = BOS_TOKENS + REPLY_PRIMER_TOKENS
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += MESSAGE_OVERHEAD_TOKENS + count_text(content)
        else:
            texts, num_other_parts = content_parts(content)
            total += MESSAGE_OVERHEAD_TOKENS + sum(map(count_text, texts)) + num_other_parts * IMAGE_PART_TOKENS
        name = message.get("name")
        if isinstance(name, str):
            total += count_text(name) + 1
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            total += count_text(repr(tool_calls))
    return total


class ExactTokenCounter:
    """Exact counts from a Hugging Face ``tokenizer.json`` (used when the config names one)."""

    __slots__ = ("_tokenizer", "path")

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer  # optional path: only loaded when a tokenizer is configured

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{self.path} is not a valid tokenizer.json: {exc}") from exc

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
