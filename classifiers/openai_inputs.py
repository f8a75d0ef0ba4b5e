"""The inputs of OpenAI's other endpoints as the bodies the classifier already reads.

The classifier reads chat ``messages`` or a completion ``prompt``; a Responses request, an embeddings
request and a rerank/score request say the same things in other words. These functions translate
them once, for the gateway (to classify and charge a request) and for the emulator (to count the
tokens it bills), so both sides agree on the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

# vLLM's /score takes its two sides under any of these pairs of names (the variants of its ScoreRequest)
SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
# Items of a Responses ``input`` that are not messages, and the chat role whose turn they stand for.
_ITEM_ROLES = {"function_call": "assistant", "function_call_output": "tool", "reasoning": "assistant"}


def responses_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """Chat messages saying what a Responses request's ``instructions`` and ``input`` say.

    ``input`` is a string (one user turn) or a list of items: messages (``role`` and ``content``,
    whose ``input_text``/``output_text`` parts carry ``text`` as chat parts do), or other items (a
    function call, its output, reasoning), counted by their JSON text in the turn they belong to."""
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list):
        return messages
    for item in items:
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
        elif isinstance(item, Mapping) and "content" in item and isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": item["content"]})
        elif isinstance(item, Mapping):
            role = _ITEM_ROLES.get(str(item.get("type")), "user")
            messages.append({"role": role, "content": orjson.dumps(item).decode()})
    return messages


def pooling_texts(value: Any) -> list[str] | list[int] | list[list[int]]:
    """The texts (or token ids) of one side of an embeddings, rerank or score request, as a completion
    ``prompt``: a string, a list of strings, token ids, or multimodal objects (their text parts)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):  # vLLM's multimodal score input: {"content": [parts]}
        parts = value.get("content")
        return [p["text"] for p in parts if isinstance(p, Mapping) and isinstance(p.get("text"), str)] if isinstance(parts, list) else []
    if not isinstance(value, list) or not value:
        return []
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if all(isinstance(v, list) for v in value):
        return [list(v) for v in value]
    texts: list[str] = []
    for v in value:
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, Mapping) and isinstance(v.get("text"), str):  # {"text": ...} documents
            texts.append(v["text"])
    return texts
