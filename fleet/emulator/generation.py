"""From an OpenAI or sglang request body to what the emulated engine generates for it.

Everything is deterministic in the prompt: the output length (when the client sets no limit, drawn
from the predicted domain's length distribution, seeded by a hash of the prompt), the filler text,
and the prefix block ids the prefix cache matches on. Prompt token counts come from the same
estimator the gateway's classifier uses, so both sides agree on usage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import zlib
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from classifiers.openai_inputs import SCORE_PAIRS, pooling_texts, responses_messages
from classifiers.output_predictor import DOMAIN_PRIORS
from classifiers.tokens import content_text, count_chat_tokens, estimate_tokens

PREFIX_BLOCK_CHARS = 2048  # about 512 tokens of English text: the engine's prefix block
_Z_P90 = 1.2815515655446004  # standard normal quantile at 0.9
_MAX_NATURAL_TOKENS = 8192
# Common English words; a token is one word with its leading space, safe inside a JSON string.
_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "or", "from", "at", "an", "which", "have", "not", "but", "had", "they", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "data", "time", "system", "value", "result", "case", "point", "number", "work", "part", "process", "order", "form", "level", "state", "rate", "group", "field", "line", "set", "way", "use", "make", "first", "new", "such", "only", "other", "about", "some", "also", "any"]
_FILLER = tuple(" " + word for word in _WORDS)


class BadRequest(ValueError):
    """A request the OpenAI API would answer with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DomainPredictor:
    """``predict(text) -> (domain, confidence)``: the classifiers' domain model, loaded once."""

    def __init__(self) -> None:
        from classifiers.domain import load_builtin_domain_model

        self._model = load_builtin_domain_model()

    def predict(self, text: str) -> tuple[str, float]:
        return self._model.predict(text)


@dataclass(frozen=True, slots=True)
class Generation:
    """One parsed inference request: what the engine generates and how to answer."""

    kind: str  # "chat", "completion" or "generate"
    prompt_tokens: int
    token_texts: tuple[str, ...]  # one per output token; len == output tokens
    finish_reason: str  # "stop" or "length"
    prefix_hash_ids: tuple[int, ...]
    domain: str
    stream: bool
    include_usage: bool
    max_tokens: int | None

    @property
    def output_tokens(self) -> int:
        return len(self.token_texts)


@dataclass(frozen=True, slots=True)
class _Sampling:
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop: tuple[str, ...]


def prompt_seed(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def text_prefix_hash_ids(text: str) -> tuple[int, ...]:
    """Ids of the text's whole leading blocks; each id hashes everything up to its block's end."""
    digest = hashlib.blake2b(digest_size=8)
    ids: list[int] = []
    for start in range(0, len(text) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
        digest.update(text[start : start + PREFIX_BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        ids.append(int.from_bytes(digest.digest(), "big") >> 1)
    return tuple(ids)


def natural_output_tokens(domain: str, seed: int) -> int:
    """A realistic answer length for the domain: log-normal through its prior p50 and p90."""
    p50, p90 = DOMAIN_PRIORS.get(domain, DOMAIN_PRIORS["chat"])
    sigma = math.log(p90 / p50) / _Z_P90
    draw = random.Random(seed).lognormvariate(math.log(p50), sigma)
    return max(1, min(_MAX_NATURAL_TOKENS, round(draw)))


def filler_tokens(seed: int, num_tokens: int) -> list[str]:
    """Deterministic filler text, one word per token."""
    state = seed & 0xFFFFFFFF
    num_words = len(_FILLER)
    texts: list[str] = []
    for _ in range(num_tokens):
        state = (1664525 * state + 1013904223) & 0xFFFFFFFF
        texts.append(_FILLER[(state >> 16) % num_words])
    return texts


def cut_at_stop(texts: list[str], stops: Sequence[str]) -> tuple[list[str], bool]:
    """Tokens up to the first stop string (its text removed, as OpenAI does); True if one was hit."""
    if not stops:
        return texts, False
    joined = "".join(texts)
    hits = [at for at in (joined.find(stop) for stop in stops if stop) if at >= 0]
    if not hits:
        return texts, False
    cut_at = min(hits)
    ends = list(accumulate(len(text) for text in texts))
    index = bisect_right(ends, cut_at)  # the token in which the stop string starts
    start = ends[index] - len(texts[index])
    return [*texts[:index], texts[index][: cut_at - start]], True


def _outputs(
    sampling: _Sampling, prompt_text: str, prompt_tokens: int, max_context: int, domains: DomainPredictor
) -> tuple[list[str], str, str]:
    """(token texts, finish reason, domain) for a prompt and its sampling parameters."""
    room = max_context - prompt_tokens
    if room < 1:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens} tokens in the messages. Please reduce the length of the messages.",
            "messages",
        )
    seed = prompt_seed(prompt_text)
    domain = domains.predict(prompt_text)[0]
    limit = min(sampling.max_tokens, room) if sampling.max_tokens is not None else room
    if sampling.ignore_eos and sampling.max_tokens is not None:
        num_tokens = limit
    else:
        num_tokens = min(max(natural_output_tokens(domain, seed), sampling.min_tokens), limit)
    finish_reason = "length" if num_tokens == limit and sampling.max_tokens is not None else "stop"
    texts, stopped = cut_at_stop(filler_tokens(seed, num_tokens), sampling.stop)
    return texts, ("stop" if stopped else finish_reason), domain


def _int_field(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}, got {value!r}", key)
    return value


def _stop_field(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(stop, str) for stop in value) and len(value) <= 4:
        return tuple(value)
    raise BadRequest("'stop' must be a string or a list of at most 4 strings", "stop")


def _not_produced(key: str) -> BadRequest:
    return BadRequest(f"the emulator does not produce '{key}' (a real engine does); send the request without it", key)


def _openai_sampling(body: Mapping[str, Any]) -> _Sampling:
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    # what a real engine computes and the emulator cannot: refused, not answered without it (a client reading
    # choices[0].logprobs would find null and fail far from the cause)
    for key in ("logprobs", "top_logprobs", "echo"):
        if body.get(key) not in (None, False, 0):
            raise _not_produced(key)
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    return _Sampling(
        max_tokens=max_tokens,
        min_tokens=_int_field(body, "min_tokens", 0) or 0,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop=_stop_field(body.get("stop")),
    )


def _hash_ids_field(body: Mapping[str, Any], text: str) -> tuple[int, ...]:
    """Mooncake-style ``hash_ids`` from a load generator when sent, else ids derived from the text."""
    hash_ids = body.get("hash_ids")
    if hash_ids is None:
        return text_prefix_hash_ids(text)
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise BadRequest("'hash_ids' must be a list of integers", "hash_ids")
    return tuple(hash_ids)


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = bool(isinstance(options, Mapping) and options.get("include_usage"))
    return stream, include_usage


def parse_chat(body: Mapping[str, Any], max_context: int, domains: DomainPredictor) -> Generation:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects", "messages")
    prompt_tokens = count_chat_tokens(messages)
    tools = body.get("tools") or body.get("functions")
    if tools:
        prompt_tokens += estimate_tokens(repr(tools))
    text = "\n".join(f"{m.get('role', '')}: {content_text(m.get('content'))[0]}" for m in messages)
    sampling = _openai_sampling(body)
    texts, finish_reason, domain = _outputs(sampling, text, prompt_tokens, max_context, domains)
    stream, include_usage = _stream_flags(body)
    return Generation("chat", prompt_tokens, tuple(texts), finish_reason, _hash_ids_field(body, text), domain,
                      stream, include_usage, sampling.max_tokens)


def _prompt_text(prompt: object, param: str) -> tuple[str, int]:
    """(text, prompt tokens) of a completion prompt: a string, one-string list, or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    raise BadRequest(f"'{param}' must be a non-empty string or list of token ids", param)


def parse_completion(body: Mapping[str, Any], max_context: int, domains: DomainPredictor) -> Generation:
    text, prompt_tokens = _prompt_text(body.get("prompt"), "prompt")
    if body.get("logprobs") is not None:  # the legacy API's is a count: 0 asks for the sampled token's own logprob
        raise _not_produced("logprobs")
    sampling = _openai_sampling(body)
    texts, finish_reason, domain = _outputs(sampling, text, prompt_tokens, max_context, domains)
    stream, include_usage = _stream_flags(body)
    return Generation("completion", prompt_tokens, tuple(texts), finish_reason, _hash_ids_field(body, text),
                      domain, stream, include_usage, sampling.max_tokens)


def parse_generate(body: Mapping[str, Any], max_context: int, domains: DomainPredictor) -> Generation:
    """sglang's native ``/generate``: ``text`` or ``input_ids`` plus ``sampling_params``."""
    prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    text, prompt_tokens = _prompt_text(prompt, "text")
    params = body.get("sampling_params") or {}
    if not isinstance(params, Mapping):
        raise BadRequest("'sampling_params' must be an object", "sampling_params")
    sampling = _Sampling(
        max_tokens=_int_field(params, "max_new_tokens", 0) if "max_new_tokens" in params else 128,
        min_tokens=_int_field(params, "min_new_tokens", 0) or 0,
        ignore_eos=bool(params.get("ignore_eos", False)),
        stop=_stop_field(params.get("stop")),
    )
    if sampling.max_tokens == 0:
        raise BadRequest("max_new_tokens must be >= 1 in the emulator", "sampling_params")
    texts, finish_reason, domain = _outputs(sampling, text, prompt_tokens, max_context, domains)
    return Generation("generate", prompt_tokens, tuple(texts), finish_reason, _hash_ids_field(body, text), domain,
                      bool(body.get("stream", False)), False, sampling.max_tokens)


def parse_responses(body: Mapping[str, Any], max_context: int, domains: DomainPredictor, context_tokens: int = 0) -> Generation:
    """The Responses API: ``instructions`` and ``input`` read as chat messages; ``context_tokens``
    (the conversation a ``previous_response_id`` continues) are added to the prompt."""
    if not isinstance(body.get("input"), str | list) or not body.get("input"):
        raise BadRequest("'input' must be a non-empty string or list of input items", "input")
    max_output = _int_field(body, "max_output_tokens", 1)
    chat = {"messages": responses_messages(body.get("instructions"), body.get("input")), "max_tokens": max_output,
            "tools": body.get("tools"), "stream": body.get("stream", False)}
    generation = parse_chat(chat, max_context - context_tokens, domains)
    return dataclasses.replace(generation, kind="responses", prompt_tokens=generation.prompt_tokens + context_tokens)


@dataclass(frozen=True, slots=True)
class Pooling:
    """One embeddings, rerank or score request: the texts to encode and their tokens (all prefilled at once)."""

    texts: tuple[str, ...]  # one per input item (token-id items as their ids' text)
    item_tokens: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.item_tokens)


def _pooling_items(value: Any, param: str) -> Pooling:
    items = pooling_texts(value)
    if not items:
        raise BadRequest(f"'{param}' must be a non-empty string, list of strings, or token ids", param)
    if isinstance(items[0], int):  # one list of token ids
        return Pooling((" ".join(map(str, items)),), (len(items),))
    texts = tuple(" ".join(map(str, item)) if isinstance(item, list) else str(item) for item in items)
    tokens = tuple(len(item) if isinstance(item, list) else estimate_tokens(str(item)) for item in items)
    return Pooling(texts, tokens)


def parse_embeddings(body: Mapping[str, Any]) -> Pooling:
    value = body.get("input")
    if isinstance(value, str) and not value:
        raise BadRequest("'input' must not be an empty string", "input")
    return _pooling_items(value, "input")


def parse_rerank(body: Mapping[str, Any]) -> tuple[Pooling, Pooling]:
    """(the query, the documents) of a rerank request."""
    if not isinstance(body.get("query"), str | Mapping):
        raise BadRequest("'query' must be a string", "query")
    return _pooling_items(body.get("query"), "query"), _pooling_items(body.get("documents"), "documents")



def parse_score(body: Mapping[str, Any]) -> tuple[Pooling, Pooling]:
    """(first side, second side) of a score request; vLLM's ScoreRequest names them in any of four ways."""
    for first, second in SCORE_PAIRS:
        if first in body:
            return _pooling_items(body.get(first), first), _pooling_items(body.get(second), second)
    raise BadRequest("'text_1' and 'text_2' are required", "text_1")


def relevance(query: str, document: str) -> float:
    """A deterministic relevance score in (0, 1): the share of the document's words found in the query,
    nudged by a hash of the pair so that ties are rare."""
    query_words = set(query.lower().split())
    document_words = document.lower().split()
    overlap = sum(word in query_words for word in document_words) / max(1, len(document_words))
    jitter = prompt_seed(query + "\x00" + document) / 0xFFFFFFFF
    return round(0.05 + 0.85 * overlap + 0.1 * jitter, 6)
