"""The fixed request and response bodies of the benchmark, so every variant moves the same bytes."""

from __future__ import annotations

import orjson

MODEL_ID = "bench-model"
CHAT_PATH = "/v1/chat/completions"


def chat_request_body(stream: bool) -> bytes:
    """A realistic small chat request: a system prompt and one user turn."""
    body: dict[str, object] = {
        "model": MODEL_ID,
        "messages": [
            {"role": "system", "content": "You are a concise assistant for a support desk."},
            {
                "role": "user",
                "content": "My order #1234 arrived with a cracked screen. What are my options "
                "for a replacement or a refund, and how long does each take?",
            },
        ],
        "max_tokens": 128,
        "temperature": 0.2,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def chat_completion_body() -> bytes:
    """What the backend answers to a non-streaming chat request."""
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL_ID,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "You can ask for a replacement (about 3 days) or a refund (about 5 days).",
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 52, "completion_tokens": 20, "total_tokens": 72},
        }
    )


def chat_stream_body() -> bytes:
    """What the backend answers to a streaming chat request: a few deltas, usage, then [DONE]."""
    pieces = ["You can ask", " for a replacement", " or a refund."]
    events: list[dict[str, object]] = []
    for index, piece in enumerate(pieces):
        delta: dict[str, str] = {"content": piece}
        if index == 0:
            delta["role"] = "assistant"
        events.append({"index": 0, "delta": delta, "finish_reason": None})
    events.append({"index": 0, "delta": {}, "finish_reason": "stop"})
    lines = [_sse_chunk({"choices": [choice]}) for choice in events]
    lines.append(_sse_chunk({"choices": [], "usage": {"prompt_tokens": 52, "completion_tokens": 9, "total_tokens": 61}}))
    lines.append(b"data: [DONE]\n\n")
    return b"".join(lines)


def _sse_chunk(fields: dict[str, object]) -> bytes:
    chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL_ID}
    chunk.update(fields)
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def models_body() -> bytes:
    return orjson.dumps(
        {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 1700000000, "owned_by": "bench"}]}
    )


def server_info_body() -> bytes:
    """sglang's ``/server_info``: what sglang-router reads from a worker when it registers it."""
    return orjson.dumps(
        {"model_path": MODEL_ID, "served_model_name": MODEL_ID, "tp_size": 1, "dp_size": 1, "version": "bench"}
    )


def model_info_body() -> bytes:
    """sglang's ``/model_info``, read with ``/server_info`` at registration."""
    return orjson.dumps(
        {"model_path": MODEL_ID, "tokenizer_path": MODEL_ID, "is_generation": True, "served_model_name": MODEL_ID}
    )
