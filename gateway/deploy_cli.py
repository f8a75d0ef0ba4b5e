"""`polymorph deploy kubernetes`: write a config's engine pools as Kubernetes manifests (fleet.kubernetes_manifests)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.kubernetes_manifests import EnginePool
    from gateway.config import GatewayConfig


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser(
        "deploy",
        help="render deployment manifests for a config's engine pools",
        description="Render deployment manifests for the engine pools of a Polymorph config.",
    )
    targets = p.add_subparsers(dest="target", metavar="<target>", required=True)
    k = targets.add_parser(
        "kubernetes",
        help="one engine Deployment and headless Service per pool, and a kustomization.yaml",
        description=(
            "Write one Deployment and one headless Service per launched pool of --config (`replicas: {launch: N}` "
            "or `{emulated: N}`; pools of fixed `urls` only are left out) into --out, and a kustomization.yaml "
            "listing them: `kubectl apply -k DIR`. Images, GPU node labels, the namespace and the drain grace "
            "come from fleet.kubernetes; each engine's arguments from its pool's engine settings (real engines "
            "name their checkpoint in engine.model_path). Files polymorph-engine-*.yaml in DIR that no pool "
            "renders any more are removed. See README, 'Deploying on Kubernetes'."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    k.add_argument("--config", type=Path, required=True, help="the Polymorph config file (see config.example.yaml)")
    k.add_argument("--out", type=Path, required=True, help="the directory to write the manifests into (created if missing)")
    k.set_defaults(handler=_run_kubernetes)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """No `polymorph bench` entries."""


def engine_pools(config: GatewayConfig) -> list[EnginePool]:
    """The config's launched pools as the cluster runs them (pools of fixed URLs only run elsewhere)."""
    from fleet.kubernetes_manifests import EnginePool
    from kernels.config import EngineConfig

    return [EnginePool(pool.name, pool.model, pool.gpu, EngineConfig.from_dict(pool.engine), pool.launch, pool.num_launched, config.emulator_speed)
            for pool in config.pools if pool.gpu is not None and (pool.num_launched or not pool.urls)]


def _run_kubernetes(args: argparse.Namespace) -> int:
    import yaml

    from fleet.kubernetes_manifests import NAME_PREFIX, deployment_name, render_engines
    from gateway.config import load_config
    from kernels.yamlsrc import ConfigError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"polymorph: invalid config: {exc}", file=sys.stderr)
        return 2
    pools = engine_pools(config)
    try:
        files = render_engines(pools, config.kubernetes)
    except ValueError as exc:
        print(f"polymorph: {args.config}: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out
    header = f"# Rendered by `polymorph deploy kubernetes` from {config.source}: edit that config and render again.\n"
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(f"{NAME_PREFIX}*.yaml"):
            if stale.name not in files:
                stale.unlink()
        for name, docs in files.items():
            (out / name).write_text(header + yaml.safe_dump_all(docs, sort_keys=False, width=1000))
    except OSError as exc:
        print(f"polymorph deploy kubernetes: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for pool in pools:
        print(f"{deployment_name(pool.name)}: {pool.num_replicas} x {pool.launch.kind} on {pool.gpu}", file=sys.stderr)
    left_out = [p.name for p in config.pools if p.name not in {q.name for q in pools}]
    if left_out:
        print(f"left out (fixed replica URLs only): {', '.join(left_out)}", file=sys.stderr)
    print(f"polymorph: wrote {len(files)} files to {out}; apply them with `kubectl apply -k {out}` (namespace {config.kubernetes.namespace})")
    return 0
