"""Response bodies in OpenAI's and sglang's wire formats.

Per-token SSE chunks are the hot path: each renderer pre-encodes everything around the text once,
so a chunk costs one ``orjson.dumps`` of the new text and a bytes join.
"""

from __future__ import annotations

from typing import Any

import orjson

from fleet.emulator.generation import Generation

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
