"""Engine answers that are the request's fault, not the replica's: a context the replica cannot hold, and
a request the engine could not parse but answered 500.

llama-server answers 400 (``exceed_context_size_error``) for a prompt longer than a slot's context, and
500 "Context size has been exceeded." when a sequence runs out of KV cells mid-request (its slots share
one pool with ``--kv-unified``: other requests hold the rest); vLLM and sglang answer 400 for a prompt
past their maximum model length. A 500 counted as a replica failure ejects a healthy replica (its
breaker opens after a few long prompts routed there); passed on as is, the client gets the engine's
own wording, or a 500 it would retry unchanged. ``context_exceeded`` recognises them so the proxy
tries another replica (a pool with a longer context, or a replica with free KV cells) and answers
OpenAI's 400 ``context_length_exceeded`` when none can hold it.

llama-server also answers 500 for ``messages`` or ``tools`` it cannot parse (a tool without its
``function``, a tool call's ``arguments`` that are not JSON): its parser's 400 wrapped in a
``std::runtime_error`` (common/chat.cpp); and for an image or audio part sent to a model it serves
without a multimodal projector. Counted as failures, three such requests eject the replica, so one
client's images (or, before gateway.validate checked their shape, its malformed tools) took a text-only
model's only replica out of service for everyone (503 for every tenant until its cool-down). ``request_refused`` recognises them: the client gets a 400 with the
engine's reason, the replica stays in, and no other replica is tried (each would refuse it alike).
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
# llama.cpp's 500s for a request it could not parse (common/chat.cpp, b1-0c1e570); vLLM and sglang answer
# such requests 400, as llama.cpp does every other malformed field
_REFUSALS = re.compile(rb"Failed to parse (?:messages|tools|tool call arguments as JSON): "
                       rb"|(?:image|audio) input is not supported")  # a text-only model (no --mmproj) sent media
_MAX_MESSAGE_CHARS = 300


def context_exceeded(status: int, body: bytes) -> str | None:
    """The engine's message when its answer ``status``/``body`` says the request's context does not fit
    (None: any other answer)."""
    if status not in (400, 413) and status < 500:
        return None
    if _PHRASES.search(body) is None:
        return None
    return _message(body)


def request_refused(status: int, body: bytes) -> str | None:
    """The engine's message when its 5xx ``status``/``body`` says it refuses the request (None: any
    other answer, a sick replica's included)."""
    if status < 500 or _REFUSALS.search(body) is None:
        return None
    return _message(body)


def _message(body: bytes) -> str:
    """The error's message in the engine's answer: OpenAI's envelope, vLLM's older flat one, or text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:_MAX_MESSAGE_CHARS].decode("utf-8", "replace")
    error = doc.get("error", doc) if isinstance(doc, dict) else None  # OpenAI's envelope, or vLLM's older flat one
    message = error.get("message") if isinstance(error, dict) else error
    text = message if isinstance(message, str) else body.decode("utf-8", "replace")
    return text[:_MAX_MESSAGE_CHARS]
