"""Real prompt text of a requested domain and exact token length, with shared prefixes by hash id.

Text comes from the per-domain corpus shipped in ``data/prompts``. A prompt without hash ids starts
at a corpus prompt chosen by the request's key and continues through the corpus (padding) until it
is long enough, then is cut to the target. With hash ids (Mooncake: one id per 512-token block),
each block's text depends only on (domain, id), so requests with equal leading ids share an
identical text prefix that a prefix cache can reuse. Token counts use the gateway's own estimate
(``classifiers.tokens``), so the prompt the gateway counts is the trace's ``input_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources

import numpy as np

from classifiers.tokens import count_chat_tokens, estimate_tokens
from loadtest.spec import HASH_BLOCK_TOKENS, RequestSpec

TokenCounter = Callable[[str], int]
_SEPARATOR = "\n\n"
_CHARS_PER_TOKEN_MAX = 6.0  # prose runs ~4 characters a token; this leaves room to cut
_MAX_CACHED_BLOCKS = 65_536
_MAX_REFINEMENTS = 12
_WEIGHT_SAMPLE_CHARS = 4000  # short enough for the estimate to count every character


@cache
def corpus(domain: str) -> tuple[str, ...]:
    """The shipped prompts of ``domain``; unknown domains fall back to chat."""
    folder = resources.files("loadtest").joinpath("data/prompts")
    name = f"{domain}.jsonl" if folder.joinpath(f"{domain}.jsonl").is_file() else "chat.jsonl"
    lines = folder.joinpath(name).read_text(encoding="utf-8").splitlines()
    return tuple(json.loads(line)["text"] for line in lines if line.strip())


def chat_overhead_tokens() -> int:
    """Tokens the chat template adds around a single user message (what the gateway counts on top)."""
    return count_chat_tokens([{"role": "user", "content": ""}])


def cut_to_tokens(text: str, num_tokens: int, count: TokenCounter = estimate_tokens) -> str:
    """The longest prefix of ``text`` whose count is at most ``num_tokens`` (exact whenever reachable).

    Per-character token weights (measured once per character through ``count`` itself) give a
    cumulative estimate for every prefix; a few real counts then correct it. The gateway's
    estimate samples windows past ~6 KiB and is not monotone there, so very long prompts may land
    a few tokens short.
    """
    if num_tokens <= 0:
        return ""
    if count(text) <= num_tokens:
        return text
    cumulative = _cumulative_weights(text, count)
    low, high = 0, len(text)  # count(text[:low]) <= num_tokens < count(text[:high])
    end = _position_of(cumulative, num_tokens + 0.5) - 1
    for _ in range(_MAX_REFINEMENTS):
        end = min(high - 1, max(low + 1, end))
        if end <= low:
            break
        tokens = count(text[:end])
        if tokens == num_tokens:
            return text[:end]
        if tokens < num_tokens:
            low = end
        else:
            high = end
        end = _position_of(cumulative, float(cumulative[end]) + num_tokens - tokens + 0.5) - 1
        if not low < end < high:
            end = (low + high) // 2
    return text[:low]


def _position_of(cumulative: np.ndarray, tokens: float) -> int:
    return int(np.searchsorted(cumulative, tokens))


_counter_to_char_weights: dict[int, np.ndarray] = {}  # id(count) -> weight per code point (NaN: not measured)


def _cumulative_weights(text: str, count: TokenCounter) -> np.ndarray:
    """cumulative[m] ~ count(text[:m]), from each character's weight count(ch * 4000) / 4000."""
    table = _counter_to_char_weights.get(id(count))
    if table is None:
        table = _counter_to_char_weights[id(count)] = np.full(0x110000, np.nan, dtype=np.float32)
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    weights = table[codes]
    unmeasured = np.isnan(weights)
    if unmeasured.any():
        for code in np.unique(codes[unmeasured]).tolist():
            table[code] = count(chr(code) * _WEIGHT_SAMPLE_CHARS) / _WEIGHT_SAMPLE_CHARS
        weights = table[codes]
    return np.concatenate(([0.0], np.cumsum(weights, dtype=np.float64)))


class PromptSource:
    """Builds prompt text for ``RequestSpec``s; deterministic for a given (spec, key)."""

    def __init__(self, count: TokenCounter = estimate_tokens, overhead_tokens: int | None = None) -> None:
        self._count = count
        self._overhead_tokens = chat_overhead_tokens() if overhead_tokens is None else overhead_tokens
        self._block_cache: dict[tuple[str, int], str] = {}

    def text_for(self, spec: RequestSpec, key: int) -> str:
        """The prompt for ``spec`` (its own text if it has one); ``key`` varies the text between requests."""
        if spec.text is not None:
            return spec.text
        num_text_tokens = max(1, spec.input_tokens - self._overhead_tokens)
        if spec.hash_ids:
            return self._with_prefix_blocks(spec.domain, spec.hash_ids, num_text_tokens, key)
        return cut_to_tokens(self._running_text(spec.domain, key, num_text_tokens), num_text_tokens, self._count)

    def _running_text(self, domain: str, key: int, num_tokens: int) -> str:
        """Corpus prompts from position ``key`` on, joined until comfortably over ``num_tokens``."""
        prompts = corpus(domain)
        parts: list[str] = []
        num_chars = 0
        index = key % len(prompts)
        while num_chars < num_tokens * _CHARS_PER_TOKEN_MAX + 64:
            parts.append(prompts[index])
            num_chars += len(prompts[index]) + len(_SEPARATOR)
            index = (index + 1) % len(prompts)
        return _SEPARATOR.join(parts)

    def _block(self, domain: str, hash_id: int) -> str:
        cache_key = (domain, hash_id)
        block = self._block_cache.get(cache_key)
        if block is None:
            # tagged with its id: the corpus repeats, so untagged blocks of different ids could read alike and
            # a text-hashing prefix cache (a router that drops hash_ids) would hit where the ids say it cannot
            text = f"[{hash_id}] " + self._running_text(domain, hash_id, HASH_BLOCK_TOKENS)
            block = cut_to_tokens(text, HASH_BLOCK_TOKENS, self._count)
            if len(self._block_cache) >= _MAX_CACHED_BLOCKS:
                self._block_cache.clear()
            self._block_cache[cache_key] = block
        return block

    def _with_prefix_blocks(self, domain: str, hash_ids: Sequence[int], num_tokens: int, key: int) -> str:
        blocks = [self._block(domain, hash_id) for hash_id in hash_ids]
        shortfall = num_tokens - HASH_BLOCK_TOKENS * len(blocks)
        if shortfall > 0:  # fewer ids than blocks: the rest is this request's own text
            blocks.append(self._running_text(domain, key, shortfall))
        return cut_to_tokens(_SEPARATOR.join(blocks), num_tokens, self._count)
