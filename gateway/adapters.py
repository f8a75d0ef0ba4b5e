"""LoRA adapters on the request path: the base model each adapter name stands for, and how /v1/models lists them.

A request names an adapter as its ``model``; it is routed to the pools that hold it (their ``PoolState.models``
carry their adapters) and sent by that name, which is how vLLM (and the emulator) select it; sglang selects an
adapter by ``"<base>:<adapter>"`` (a bare adapter name would be served by the base model), so a request bound for
an sglang replica names it so (``engine_model``). The classifier never reads the model
name and the performance model times each pool's base model, so an adapter costs what its base costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import orjson

from gateway.config import PoolSpec, Tenant


def adapter_bases(pools: Sequence[PoolSpec]) -> dict[str, str]:
    """Adapter name -> the base model it adapts (config validation makes that one model fleet-wide)."""
    return {name: pool.model for pool in pools for name in pool.adapter_names}


def model_adapters(pools: Sequence[PoolSpec], model: str) -> tuple[tuple[str, str], ...]:
    """Every LoRA adapter (name, path) the declared pools of ``model`` load, each once: what a pool the
    controller makes for that model loads too, so an adapter's requests may go there as to its declared pools."""
    found: dict[str, str] = {}
    for pool in pools:
        if pool.model == model:
            found.update((name, path) for name, path in pool.launch.adapters if name not in found)
    return tuple(found.items())


def listed_adapters(bases: Mapping[str, str], tenant: Tenant) -> list[dict[str, object]]:
    """/v1/models entries of the adapters ``tenant`` may use: with their ``parent`` as vLLM lists them, but no
    ``root``, which would show tenants a path on the engines' hosts."""
    return [{"id": name, "object": "model", "created": 0, "owned_by": "polymorph", "parent": base}
            for name, base in sorted(bases.items()) if tenant.may_use_adapter(name, base)]


def engine_model(engine_kind: str, model: str, base: str | None) -> str | None:
    """The ``model`` a replica of ``engine_kind`` must be sent for a request naming ``model`` (an adapter of
    ``base``, or None), when it differs from the client's; None: send the body as it is."""
    return f"{base}:{model}" if base is not None and engine_kind == "sglang" else None


def with_model(raw: bytes, model: str) -> bytes:
    """``raw`` (a JSON object) with its ``model`` replaced: re-encoded, paid only by adapter requests to sglang."""
    body = orjson.loads(raw)
    body["model"] = model
    return orjson.dumps(body)
