"""Prefix fingerprints: which chats share a cacheable prompt prefix, for prefix affinity.

A fingerprint is a stable 32-bit hash (0: none) of what a chat shares with other requests. Requests
with equal fingerprints are steered to the same replica (fleet.router: rendezvous hashing with
bounded load), whose engine's prefix cache then holds that part already. crc32 rather than
``hash()``: every gateway process and restart must steer a prefix alike.

Two things are known to be shared without any history:

- a leading system (or developer) prompt, an application's declared template (its first
  ``PREFIX_FP_CHARS``: requests that agree that far share at least that much cacheable prefix, and a
  32k-token system prompt costs what a short one does);
- without one, the earlier turns of a conversation under way (more than one message): every turn
  resends the turns before it, so from its second turn a conversation keeps to one replica, once its
  history reaches ``HEAD_FP_CHARS`` (about 256 tokens; shorter is not worth steering for).

A single message without a system prompt is not fingerprinted: alone it cannot tell a template
someone else also sends from a one-off document, and steering one-offs by hash places them at random,
which balances worse than load does. Measured: fingerprinting repeated heads of single messages too
(a 512-token instruction in front of every document, a 1,024-token prompt in front of every chat)
split the documents 129 : 65 between two long-context replicas and doubled their TTFT p99 in
`polymorph bench peers --parts routing`, for no clear gain in goodput (classifiers/README.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from classifiers.tokens import content_parts

PREFIX_FP_CHARS = 4096
HEAD_FP_CHARS = 1024


def _head_crc(contents: Iterable[Any], num_chars: int) -> tuple[int, bool]:
    """crc32 of the first ``num_chars`` characters of the text of message ``contents``, and whether the
    text reaches that far. Plain loops: this runs for every chat on the hot path."""
    crc = 0
    for content in contents:
        for text in (content,) if isinstance(content, str) else content_parts(content)[0]:
            piece = text[:num_chars]
            crc = zlib.crc32(piece.encode("utf-8", "surrogatepass"), crc)
            num_chars -= len(piece)
            if num_chars <= 0:
                return crc, True
    return crc, False


def prefix_fingerprint(messages: list[Any]) -> int:
    """The fingerprint of a chat's shared prefix: its system prompt, else its history (0: none)."""
    system: list[Any] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ("system", "developer"):
            break
        system.append(message.get("content"))
    if system:
        crc, _ = _head_crc(system, PREFIX_FP_CHARS)
        if crc:
            return crc
    if len(messages) - len(system) < 2:
        return 0
    history = (m.get("content") for m in messages[len(system):] if isinstance(m, Mapping))
    crc, long_enough = _head_crc(history, HEAD_FP_CHARS)
    return crc if long_enough else 0
