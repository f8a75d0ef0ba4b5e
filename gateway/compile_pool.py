"""`polymorph compile --fleet-config FILE --pool NAME`: compile for one of a gateway config's pools, and with
``--evaluator probe`` measure the candidates where that gateway would run them.

The pool gives what the compile flags would: its model, its device kind and GPUs per replica, its engine
(kind, binary or interpreter, weights) and, when it serves one shape, the shape. A probe takes devices of
``fleet.devices`` that none of the config's launched replicas holds (``gateway.replicas.assign_devices``,
the assignment ``polymorph serve`` makes), so it never shares a GPU with the fleet: on GPUs their ids go to
the engine as ``CUDA_VISIBLE_DEVICES``; a CPU engine needs one free slot. With none free it says so: trial
the configuration on a live replica instead (``POST /admin/canary``: drained, restarted, judged, rolled back).
"""

from __future__ import annotations

import argparse
import shlex
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: `polymorph --help` stays instant
    from gateway.config import GatewayConfig, PoolSpec

# the flags the pool stands for (each parser default is None), refused beside --fleet-config so none is silently overridden
_FROM_POOL = ("model", "gpu", "engine_command", "model_path", "devices")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-config", type=Path, metavar="FILE",
                        help="a gateway config: compile for its pool --pool (model, GPU kind, engine, weights and, when it "
                        "serves one, the shape); a probe runs on devices of fleet.devices no launched replica holds")
    parser.add_argument("--pool", help="with --fleet-config: the pool to compile for")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the pool's settings filled in (unchanged without --fleet-config); SystemExit with the reason."""
    from gateway.config import load_config, replica_devices
    from kernels.yamlsrc import ConfigError

    if args.fleet_config is None:
        if args.pool is not None:
            raise SystemExit("polymorph compile: --pool names a pool of --fleet-config FILE")
        return args
    given = [f"--{name.replace('_', '-')}" for name in _FROM_POOL if getattr(args, name) is not None]
    if given:
        raise SystemExit(f"polymorph compile: --fleet-config takes {', '.join(given)} from the pool; leave them out")
    try:
        config = load_config(args.fleet_config)
    except ConfigError as exc:
        raise SystemExit(f"polymorph compile: invalid config: {exc}") from None
    pool = _pool(config, args.pool)
    out = argparse.Namespace(**vars(args))
    out.model, out.gpu, out.gpus = pool.model, pool.gpu, replica_devices(pool)
    # --gpus and --engine have defaults, so only a value that differs from both the default and the pool's
    # shows it was given against the pool (before, the pool's silently won)
    if args.gpus not in (1, out.gpus):
        raise SystemExit(f"polymorph compile: pool {pool.name!r}'s replicas hold {out.gpus} device(s); leave --gpus out")
    if args.engine != "sglang" and args.engine != pool.engine_kind:
        raise SystemExit(f"polymorph compile: pool {pool.name!r} runs {pool.engine_kind}; leave --engine out")
    if args.shape is not None and pool.shapes and args.shape not in pool.shapes:
        raise SystemExit(f"polymorph compile: pool {pool.name!r} serves {', '.join(pool.shapes)}, not {args.shape!r}")
    out.shape = args.shape or (None if args.trace is not None else _only_shape(pool))  # a --trace is the shape
    if args.evaluator == "probe":
        if pool.engine_kind == "emulated":
            raise SystemExit(f"polymorph compile: pool {pool.name!r} runs emulated replicas; a probe measures a real engine "
                             "(engine.kind: llamacpp, vllm or sglang)")
        out.engine = pool.engine_kind
        out.engine_command = shlex.join(pool.launch.command) if pool.launch.command else None
        out.model_path = pool.launch.model_path
        ids = free_devices(config, pool)
        out.devices = ",".join(ids) if pool.gpu != "cpu" else None  # a CPU probe runs on one core: no ids to give
    return out


def free_devices(config: GatewayConfig, pool: PoolSpec) -> tuple[str, ...]:
    """One replica's worth of the devices of ``pool``'s kind that no launched replica holds; SystemExit when too few."""
    from gateway.config import replica_devices
    from gateway.replicas import assign_devices

    assert pool.gpu is not None
    held, free = assign_devices(config)
    declared = config.devices.get(pool.gpu)
    if declared is None:
        raise SystemExit(f"polymorph compile: fleet.devices declares no {pool.gpu} devices: declare them "
                         f"(`{pool.gpu}: {{ids: [...]}}`) so a probe can take ones the fleet does not hold")
    need = replica_devices(pool)
    spare = free.get(pool.gpu, ())
    if len(spare) < need:
        holders = [f"{name} x{n}" for name, n in sorted(Counter(p.name for _, p, _ in held if p.gpu == pool.gpu).items())]
        raise SystemExit(f"polymorph compile: the launched replicas hold {len(declared) - len(spare)} of fleet.devices' {len(declared)} "
                         f"{pool.gpu} devices ({', '.join(holders)}); a probe needs {need} free: declare a spare one, or trial the "
                         "configuration on a live replica (POST /admin/canary)")
    return spare[:need]


def _pool(config: GatewayConfig, name: str | None) -> PoolSpec:
    names = [p.name for p in config.pools]
    if name is None:
        raise SystemExit(f"polymorph compile: --fleet-config needs --pool, one of {', '.join(names)}")
    found = next((p for p in config.pools if p.name == name), None)
    if found is None:
        raise SystemExit(f"polymorph compile: no pool {name!r} in the config; its pools: {', '.join(names)}")
    if found.gpu is None:
        raise SystemExit(f"polymorph compile: pool {name!r} names no gpu (its replicas are URLs): nothing to compile for")
    return found


def _only_shape(pool: PoolSpec) -> str:
    if len(pool.shapes) != 1:
        raise SystemExit(f"polymorph compile: pool {pool.name!r} serves {', '.join(pool.shapes) or 'no shape'}; give --shape")
    return pool.shapes[0]
