"""Engine answers that are the request's fault, not the replica's: a context the replica cannot hold.

llama-server answers 400 (``exceed_context_size_error``) for a prompt longer than a slot's context, and
500 "Context size has been exceeded." when a sequence runs out of KV cells mid-request (its slots share
one pool with ``--kv-unified``: other requests hold the rest); vLLM and sglang answer 400 for a prompt
past their maximum model length. A 500 counted as a replica failure ejects a healthy replica (its
breaker opens after a few long prompts routed there); passed on as is, the client gets the engine's
own wording, or a 500 it would retry unchanged. ``context_exceeded`` recognises them so the proxy
tries another replica (a pool with a longer context, or a replica with free KV cells) and answers
OpenAI's 400 ``context_length_exceeded`` when none can hold it.
"""

from __future__ import annotations

import re

import orjson

_PHRASES = re.compile(
    rb"context size has been exceeded"  # llama.cpp, KV cells ran out (500)
    rb"|exceeds the available context size|exceed_context_size_error"  # llama.cpp, prompt past the slot's context (400)
    rb"|maximum context length"  # vLLM (and OpenAI's own wording)
    rb"|longer than the maximum model length"  # vLLM
    rb"|longer than the model's context length",  # sglang
    re.IGNORECASE,
)
_MAX_MESSAGE_CHARS = 300


def context_exceeded(status: int, body: bytes) -> str | None:
    """The engine's message when its answer ``status``/``body`` says the request's context does not fit
    (None: any other answer)."""
    if status not in (400, 413) and status < 500:
        return None
    if _PHRASES.search(body) is None:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:_MAX_MESSAGE_CHARS].decode("utf-8", "replace")
    error = doc.get("error", doc) if isinstance(doc, dict) else None  # OpenAI's envelope, or vLLM's older flat one
    message = error.get("message") if isinstance(error, dict) else error
    text = message if isinstance(message, str) else body.decode("utf-8", "replace")
    return text[:_MAX_MESSAGE_CHARS]
