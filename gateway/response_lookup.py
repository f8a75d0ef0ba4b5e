"""Which replica holds a stored Responses id that this gateway process did not proxy: ask them.

An engine keeps the responses it stored in its own memory, so only the replica that produced one can
continue it (``previous_response_id``) or show it (``GET /v1/responses/{id}``). A process knows the ids
it proxied itself (``gateway.response_ids``); an id another ``--workers`` process or another gateway host
proxied is found by asking the candidate replicas at once for ``GET /v1/responses/{id}``, which vLLM,
sglang and the emulator answer 200 only where the response is stored. The first 200 wins and the
caller remembers it, so a conversation pays the fan-out once per process. Ids are checked against the
engines' own alphabet first, so a client cannot steer the path of the request we send.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from fleet.pool import ReplicaState

# vLLM's ids are resp_<hex>, sglang's resp_<uuid hex>, the emulator's resp-<hex>
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_-]{1,200}$")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    replica: ReplicaState
    body: bytes  # the replica's answer to GET /v1/responses/{id}: the response object


async def _ask(session: aiohttp.ClientSession, replica: ReplicaState, response_id: str, timeout_s: float) -> StoredResponse | None:
    try:
        async with session.get(f"{replica.url}/v1/responses/{response_id}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return StoredResponse(replica, await resp.read())
    except (aiohttp.ClientError, TimeoutError):
        return None  # a replica that cannot answer now cannot continue the conversation either


async def find_stored(session: aiohttp.ClientSession, replicas: Sequence[ReplicaState], response_id: str,
                      timeout_s: float) -> StoredResponse | None:
    """The first of ``replicas`` that holds ``response_id``, with its stored response; None when none does
    (or the id is not one an engine could have made)."""
    if not RESPONSE_ID.match(response_id) or not replicas:
        return None
    pending = {asyncio.ensure_future(_ask(session, r, response_id, timeout_s)) for r in replicas}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                found = task.result()
                if found is not None:
                    return found
        return None
    finally:
        for task in pending:
            task.cancel()
