"""`polymorph controller`: the fleet's control loop as its own process (``fleet.controller.mode: external``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.config import GatewayConfig


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser(
        "controller",
        help="run the fleet controller beside several gateway processes",
        description=(
            "Run the control loop out of the gateway: it starts (or adopts) the config's launched replicas (emulated or "
            "real engines, each on its share of fleet.devices), "
            "serves the plan at fleet.controller.url (GET /plan) to gateways started with fleet.controller.mode: "
            "external, takes their telemetry (POST /report), and persists its state to fleet.controller.state_file "
            "(default: beside the decision log). Run it twice for a standby: the second waits for the lease and "
            "takes over, resuming the rollout in progress, when the leader dies. The lease is a lock beside the state "
            "file (fleet.controller.leader_election: file) or a Kubernetes Lease (kubernetes; the state file must "
            "then be on a volume every controller mounts)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", type=Path, required=True, help="the gateways' config file (see config.example.yaml)")
    p.add_argument("--replica-logs", type=Path, help="where replicas write their logs (default: a temp dir)")
    p.add_argument("--stop-replicas-on-exit", action="store_true",
                   help="stop the replicas on SIGTERM/SIGINT (by default they outlive the controller, for the next one to adopt)")
    p.set_defaults(handler=_run_controller)


def _run_controller(args: argparse.Namespace) -> int:
    import orjson
    import uvloop

    from fleet.controller_state import ControllerState
    from gateway.config import load_config
    from gateway.controller_service import ControllerService, serve, state_path
    from gateway.listen import hold_address
    from gateway.replicas import EMULATE_COMMAND
    from kernels.yamlsrc import ConfigError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"polymorph: invalid config: {exc}", file=sys.stderr)
        return 2
    settings = config.controller
    path = state_path(config)
    if settings.mode != "external" or settings.url is None or path is None:
        print("polymorph: the controller needs fleet.controller.mode: external, its url, and a state_file or decision_log", file=sys.stderr)
        return 2
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where the folder should be (was a traceback)
        print(f"polymorph: cannot make the folder of the controller state {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    release = _lead(config, path)
    if release is None:
        return 2
    try:
        state = ControllerState.from_json(orjson.loads(path.read_bytes())) if path.exists() else None
    except (OSError, ValueError) as exc:
        print(f"polymorph: cannot read the controller state {path}: {exc}", file=sys.stderr)
        release()
        return 2
    where = urlsplit(settings.url)
    try:
        held = hold_address(where.hostname or "127.0.0.1", where.port or 80)  # as controller_service.serve listens
    except OSError as exc:
        print(f"polymorph: cannot listen on {settings.url}: {exc.strerror or exc}", file=sys.stderr)
        release()
        return 2
    log_dir = args.replica_logs or Path(tempfile.mkdtemp(prefix="polymorph-replicas-"))
    try:
        service = ControllerService(config, path, EMULATE_COMMAND, log_dir)
    except ValueError as exc:
        print(f"polymorph: {exc}", file=sys.stderr)
        if held is not None:
            held.close()
        release()
        return 2
    if state is None:
        service.fresh_fleet()
    else:
        print(f"polymorph: resuming from {path} (plan version {state.plan_version}"
              f"{', rollout in progress' if state.rollout_in_progress else ''})", file=sys.stderr, flush=True)
        service.adopt(state)
    try:
        service.build_controller(state)
        uvloop.run(serve(service))
    except OSError as exc:
        print(f"polymorph: cannot listen on {settings.url}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if held is not None:
            held.close()
        if args.stop_replicas_on_exit:
            service.stop_replicas()
        release()
    return 0


def _lead(config: GatewayConfig, path: Path) -> Callable[[], None] | None:
    """Block until this controller leads (``fleet.controller.leader_election``); returns what releases the
    lease on a clean exit, or None when it cannot take part (said on stderr)."""
    from gateway.controller_service import hold_lease

    settings = config.controller
    if settings.leader_election == "file":
        return hold_lease(path.with_name(path.name + ".lease"), f"polymorph: standby: another controller holds {path}.lease; waiting to take over").close
    try:
        from gateway.kube_lease import KubeLease, holder_identity
    except ImportError as exc:
        print(f"polymorph: leader_election: kubernetes needs the kubernetes client (pip install -e '.[kubernetes]'): {exc}", file=sys.stderr)
        return None
    lease = KubeLease(settings, config.kubernetes.namespace, config.kubernetes.kubeconfig, holder_identity())
    lease.acquire(lambda why: print(f"polymorph: standby: {why}; waiting to take over", file=sys.stderr, flush=True))
    print(f"polymorph: leading as {lease.identity} (Lease {lease.where})", file=sys.stderr, flush=True)
    return lease.close
