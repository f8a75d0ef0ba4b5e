"""Response bodies in OpenAI's and sglang's wire formats.

Per-token SSE chunks are the hot path: each renderer pre-encodes everything around the text once,
so a chunk costs one ``orjson.dumps`` of the new text and a bytes join.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from fleet.emulator.generation import Generation, Pooling, prompt_seed, relevance

DONE = b"data: [DONE]\n\n"
_SENTINEL = "\x01text\x01"
_SENTINEL_JSON = orjson.dumps(_SENTINEL)


def usage(generation: Generation, num_cached_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": generation.prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class OpenAIRenderer:
    """Chat (``chat.completion``) or text (``text_completion``) responses for one request."""

    __slots__ = ("generation", "req_id", "model", "created", "_chunk_head", "_chunk_tail")

    def __init__(self, generation: Generation, req_id: str, model: str, created: int) -> None:
        self.generation = generation
        self.req_id = req_id
        self.model = model
        self.created = created
        template = self._chunk({"content": _SENTINEL} if self.is_chat else _SENTINEL, None)
        self._chunk_head, self._chunk_tail = _sse(template).split(_SENTINEL_JSON)

    @property
    def is_chat(self) -> bool:
        return self.generation.kind == "chat"

    def _chunk(self, delta_or_text: object, finish_reason: str | None) -> dict[str, Any]:
        if self.is_chat:
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.req_id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def first_chunk(self) -> bytes:
        """The chat role announcement (completions have none)."""
        return _sse(self._chunk({"role": "assistant", "content": ""}, None)) if self.is_chat else b""

    def text_chunk(self, start: int, end: int) -> bytes:
        text = "".join(self.generation.token_texts[start:end])
        return self._chunk_head + orjson.dumps(text) + self._chunk_tail

    def last_chunks(self, num_cached_tokens: int, include_usage: bool) -> bytes:
        gen = self.generation
        final = _sse(self._chunk({} if self.is_chat else "", gen.finish_reason))
        if include_usage:
            body = self._chunk({}, None)
            body["choices"] = []
            body["usage"] = usage(gen, num_cached_tokens, gen.output_tokens)
            final += _sse(body)
        return final + DONE

    def full(self, num_cached_tokens: int) -> bytes:
        gen = self.generation
        text = "".join(gen.token_texts)
        if self.is_chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text}
            kind = "text_completion"
        choice.update(logprobs=None, finish_reason=gen.finish_reason)
        return orjson.dumps({
            "id": self.req_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(gen, num_cached_tokens, gen.output_tokens),
        })


class GenerateRenderer:
    """sglang's native ``/generate`` answers: the text so far plus ``meta_info``."""

    __slots__ = ("generation", "req_id")

    def __init__(self, generation: Generation, req_id: str) -> None:
        self.generation = generation
        self.req_id = req_id

    def _body(self, num_tokens: int, num_cached_tokens: int, finished: bool, e2e_latency_s: float) -> dict[str, Any]:
        gen = self.generation
        finish: dict[str, Any] | None = None
        if finished:
            finish = {"type": "length", "length": num_tokens} if gen.finish_reason == "length" else {"type": "stop", "matched": None}
        return {
            "text": "".join(gen.token_texts[:num_tokens]),
            "meta_info": {
                "id": self.req_id,
                "finish_reason": finish,
                "prompt_tokens": gen.prompt_tokens,
                "completion_tokens": num_tokens,
                "cached_tokens": num_cached_tokens,
                "e2e_latency": e2e_latency_s,
            },
            "index": 0,
        }

    def chunk(self, num_tokens: int, num_cached_tokens: int, finished: bool, e2e_latency_s: float) -> bytes:
        return _sse(self._body(num_tokens, num_cached_tokens, finished, e2e_latency_s))

    def full(self, num_cached_tokens: int, e2e_latency_s: float) -> bytes:
        return orjson.dumps(self._body(self.generation.output_tokens, num_cached_tokens, True, e2e_latency_s))


def embedding_vector(text: str, num_dimensions: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A unit vector seeded by the text: the same text always embeds the same way."""
    vector = np.random.default_rng(prompt_seed(text)).standard_normal(num_dimensions).astype(np.float32)
    return vector / np.float32(np.linalg.norm(vector))


def embeddings_body(pooling: Pooling, model: str, num_dimensions: int, base64_encoded: bool) -> bytes:
    data = []
    for index, text in enumerate(pooling.texts):
        vector = embedding_vector(text, num_dimensions)
        # base64 is the float32 bytes, little-endian, as OpenAI sends them (the openai SDK asks for it)
        encoded: object = base64.b64encode(vector.astype("<f4").tobytes()).decode() if base64_encoded else vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = pooling.prompt_tokens
    return orjson.dumps({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def rerank_body(req_id: str, query: Pooling, documents: Pooling, model: str, top_n: int, return_documents: bool) -> bytes:
    """vLLM's (and Cohere's) rerank answer: documents by relevance, best first."""
    text = " ".join(query.texts)
    scored = sorted(((relevance(text, doc), i, doc) for i, doc in enumerate(documents.texts)), key=lambda item: (-item[0], item[1]))
    results = [
        {"index": i, "document": {"text": doc} if return_documents else None, "relevance_score": score}
        for score, i, doc in scored[: top_n or len(scored)]
    ]
    tokens = query.prompt_tokens * len(documents.texts) + documents.prompt_tokens
    return orjson.dumps({"id": req_id, "model": model, "usage": {"total_tokens": tokens}, "results": results})


def score_body(req_id: str, first: Pooling, second: Pooling, model: str, created: int) -> bytes:
    """vLLM's score answer: one score per pair (one first text against many, or pairwise)."""
    lefts = first.texts * len(second.texts) if len(first.texts) == 1 else first.texts
    data = [{"index": i, "object": "score", "score": relevance(left, right)} for i, (left, right) in enumerate(zip(lefts, second.texts))]
    tokens = first.prompt_tokens * (len(second.texts) if len(first.texts) == 1 else 1) + second.prompt_tokens
    return orjson.dumps({"id": req_id, "object": "list", "created": created, "model": model, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


def _event(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponsesRenderer:
    """The Responses API's ``response`` object and its stream of typed events for one request."""

    __slots__ = ("generation", "req_id", "model", "created", "body", "message_id", "_sequence")

    def __init__(self, generation: Generation, req_id: str, model: str, created: int, body: dict[str, Any]) -> None:
        self.generation = generation
        self.req_id = req_id
        self.model = model
        self.created = created
        self.body = body
        self.message_id = "msg_" + req_id.removeprefix("resp_")
        self._sequence = 0

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self, status: str, num_cached_tokens: int = 0) -> dict[str, Any]:
        gen = self.generation
        done = status != "in_progress"
        text = "".join(gen.token_texts)
        body = self.body
        return {
            "id": self.req_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": [self._message(text, "completed")] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "metadata": {},
            "usage": {
                "input_tokens": gen.prompt_tokens,
                "input_tokens_details": {"cached_tokens": num_cached_tokens},
                "output_tokens": gen.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": gen.prompt_tokens + gen.output_tokens,
            } if done else None,
        }

    @property
    def final_status(self) -> str:
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def full(self, num_cached_tokens: int) -> bytes:
        return orjson.dumps(self.response(self.final_status, num_cached_tokens))

    def _next(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return _event(event)

    def first_events(self) -> bytes:
        created = self.response("in_progress")
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self._next({"type": "response.created", "response": created}),
            self._next({"type": "response.in_progress", "response": created}),
            self._next({"type": "response.output_item.added", "output_index": 0, "item": self._message("", "in_progress")}),
            self._next({"type": "response.content_part.added", **where, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ))

    def delta(self, start: int, end: int) -> bytes:
        text = "".join(self.generation.token_texts[start:end])
        return self._next({"type": "response.output_text.delta", "item_id": self.message_id, "output_index": 0, "content_index": 0,
                           "delta": text, "logprobs": []})

    def last_events(self, num_cached_tokens: int) -> bytes:
        text = "".join(self.generation.token_texts)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        status = self.final_status
        return b"".join((
            self._next({"type": "response.output_text.done", **where, "text": text, "logprobs": []}),
            self._next({"type": "response.content_part.done", **where, "part": {"type": "output_text", "text": text, "annotations": []}}),
            self._next({"type": "response.output_item.done", "output_index": 0, "item": self._message(text, "completed")}),
            self._next({"type": f"response.{status}", "response": self.response(status, num_cached_tokens)}),
        ))
