"""OpenAI's endpoints beyond chat and completions: embeddings, Responses, and the engines' rerank/score.

Each endpoint checks its body (every 400 names the field) and says what the rest of the request path
needs: the model to route by, whether it streams, a body the classifier reads (a completion
``prompt`` or chat ``messages``), the output tokens the tenant's token limits are charged for, and
how the proxy reads the engine's answer (``Wire``). Unknown fields pass through to the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from classifiers.openai_inputs import SCORE_PAIRS, pooling_texts, responses_messages
from gateway.errors import ApiError
from gateway.proxy import EMBEDDINGS_WIRE, RERANK_WIRE, RESPONSES_WIRE, SCORE_WIRE, Wire

# The engines' rerank and score paths (vLLM serves all four; sglang serves /v1/rerank), passed through as they came.
RERANK_PATHS = ("/v1/rerank", "/rerank")
SCORE_PATHS = ("/v1/score", "/score")
MAX_INPUT_ITEMS = 2048  # OpenAI's limit on an embeddings input array; the same for documents to rank
_MAX_OUTPUT_TOKENS = 10_000_000


@dataclass(frozen=True, slots=True)
class Parsed:
    """What one valid request of an endpoint means to the gateway."""

    model: str
    stream: bool
    classify_body: dict[str, Any]  # what the classifier reads: ``chat`` messages or a completion prompt
    chat: bool
    max_output_tokens: int | None  # the client's cap on output; None: the predicted length is charged
    has_output: bool  # False: the engine generates nothing (embeddings, scores); only input is charged
    previous_response_id: str | None = None
    store: bool = True  # a Responses answer the engine keeps (and a follow-up may name)


@dataclass(frozen=True, slots=True)
class Meter:
    """How an endpoint's requests are recorded: its name in the access log, the ``kind`` labels of its
    usage in ``polymorph_tokens_total``, and whether its output lengths teach the output predictor."""

    name: str
    input_kind: str
    output_kind: str
    learns_output: bool


@dataclass(frozen=True, slots=True)
class Endpoint:
    parse: Callable[[Any], Parsed]
    wire: Wire
    meter: Meter


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_value" if "must" in message else "invalid_request", param)


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required and must be a non-empty string.")
    return model


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_input(value: Any, param: str) -> None:
    """A string, or a non-empty array (at most MAX_INPUT_ITEMS) of strings, of token ids, or of token-id arrays."""
    if isinstance(value, str):
        if not value:
            raise _bad(param, f"'{param}' must not be an empty string.")
        return
    if not isinstance(value, list) or not value:
        raise _bad(param, f"'{param}' is required and must be a string or a non-empty array of strings or token ids.")
    if len(value) > MAX_INPUT_ITEMS:
        raise _bad(param, f"'{param}' must have at most {MAX_INPUT_ITEMS} items; got {len(value)}.")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise _bad(param, f"'{param}' must not contain empty strings.")
        return
    if _is_ids(value) or all(_is_ids(v) for v in value):
        return
    raise _bad(param, f"'{param}' must be a string, an array of strings, an array of token ids, or an array of token-id arrays.")


def parse_embeddings(body: Any) -> Parsed:
    model = _model(body)
    value = body.get("input")
    _check_input(value, "input")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise _bad("encoding_format", "'encoding_format' must be 'float' or 'base64'.")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise _bad("dimensions", "'dimensions' must be a positive integer.")
    return Parsed(model, False, {"prompt": value, "max_tokens": 1}, False, 0, False)


def _optional_int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(name, f"'{name}' must be an integer between {low} and {high}.")
    return value


def _optional_number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high):
        raise _bad(name, f"'{name}' must be a number between {low:g} and {high:g}.")


def parse_responses(body: Any) -> Parsed:
    model = _model(body)
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise _bad("input", "'input' must not be an empty string.")
    elif not isinstance(items, list) or not items or not all(isinstance(item, dict | str) for item in items):
        raise _bad("input", "'input' is required and must be a string or a non-empty array of input items.")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "'instructions' must be a string.")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be a boolean.")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise _bad("store", "'store' must be a boolean.")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("previous_response_id", "'previous_response_id' must be a non-empty string.")
    max_output = _optional_int(body, "max_output_tokens", 1, _MAX_OUTPUT_TOKENS)
    _optional_number(body, "temperature", 0.0, 2.0)
    _optional_number(body, "top_p", 0.0, 1.0)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "'tools' must be an array.")
    classify_body: dict[str, Any] = {"messages": responses_messages(instructions, items), "max_tokens": max_output, "stream": stream is True}
    if tools:
        classify_body["tools"] = tools
    return Parsed(model, stream is True, classify_body, True, max_output, True, previous, store is not False)


def _check_side(value: Any, param: str) -> None:
    """One side of a rerank or score request: a string, an array of strings (or ``{"text"}`` documents),
    or a multimodal object (vLLM's ``{"content": [...]}``)."""
    if isinstance(value, str) and value:
        return
    if isinstance(value, dict):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("text"), str)) for v in value):
        if len(value) > MAX_INPUT_ITEMS:
            raise _bad(param, f"'{param}' must have at most {MAX_INPUT_ITEMS} items; got {len(value)}.")
        return
    raise _bad(param, f"'{param}' is required and must be a non-empty string, an array of strings, or a multimodal object.")


def _pooling_body(*sides: Any) -> dict[str, Any]:
    """A completion-like body whose prompt is the texts of all ``sides`` (their tokens are the input)."""
    texts: list[Any] = []
    for side in sides:
        texts += pooling_texts(side)
    return {"prompt": texts or "", "max_tokens": 1}


def parse_rerank(body: Any) -> Parsed:
    model = _model(body)
    query = body.get("query")
    if isinstance(query, list):
        raise _bad("query", "'query' must be a string, not an array.")
    _check_side(query, "query")
    documents = body.get("documents")
    if not isinstance(documents, list | dict):
        raise _bad("documents", "'documents' is required and must be an array of strings.")
    _check_side(documents, "documents")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise _bad("top_n", "'top_n' must be a non-negative integer.")
    return Parsed(model, False, _pooling_body(query, documents), False, 0, False)


def parse_score(body: Any) -> Parsed:
    model = _model(body)
    pair = next(((first, second) for first, second in SCORE_PAIRS if first in body), None)
    if pair is None:
        raise _bad("text_1", "Send the two sides to score as 'text_1' and 'text_2' (or 'queries' and 'documents').")
    first, second = pair
    _check_side(body.get(first), first)
    _check_side(body.get(second), second)
    return Parsed(model, False, _pooling_body(body[first], body[second]), False, 0, False)


def _meter(name: str, learns_output: bool = False) -> Meter:
    return Meter(name, f"{name}_input", f"{name}_output", learns_output)


# Chat and completions keep the token kinds they always had (dashboards read them); the others name theirs.
CHAT_METER = Meter("chat.completions", "prompt", "completion", True)
COMPLETIONS_METER = Meter("completions", "prompt", "completion", True)
EMBEDDINGS = Endpoint(parse_embeddings, EMBEDDINGS_WIRE, _meter("embeddings"))
RESPONSES = Endpoint(parse_responses, RESPONSES_WIRE, _meter("responses", learns_output=True))
RERANK = Endpoint(parse_rerank, RERANK_WIRE, _meter("rerank"))
SCORE = Endpoint(parse_score, SCORE_WIRE, _meter("score"))
