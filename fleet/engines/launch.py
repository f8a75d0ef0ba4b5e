"""How a pool's replicas are launched: the engine kind, its command and model, rendered per engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """A pool's ``engine:`` launch settings (the rest of that mapping is its ``EngineConfig``).

    ``command`` empty: the kind's default (the installed CPU engine, or ``python3 -m sglang.launch_server``);
    ``model_path`` None: the kind's default (the tiny test model for the CPU engines)."""

    kind: str
    command: tuple[str, ...] = ()
    model_path: str | None = None
    served_model_name: str = ""
    threads: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
