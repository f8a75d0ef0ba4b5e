"""free_port hands out listenable ports that a client socket cannot take first; a replica that still loses its
port to another process before it listens starts again on another."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from fleet.actuators.local import LaunchSpec, LocalActuator, emulated_replica_argv, free_port
from fleet.actuators.local_slots import LocalSlots
from fleet.controller_state import SlotRecord
from gateway.config import load_config
from gateway.controller_service import ControllerService
from gateway.replicas import EMULATE_COMMAND
from loadtest.chaos.fleet_faults import GPU, MODEL, write_fleet_config


def test_ports_are_below_the_ephemeral_range_distinct_and_skip_a_taken_one() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    first = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))  # the walk's next port is taken meanwhile: it is skipped
        held.listen()
        ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < ephemeral_low for p in [first, *ports])
    assert first + 1 not in ports and len(set(ports)) == 20 and first not in ports
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports[0]))  # what a child does with it
        server.listen()

SLOT = f"{GPU}/0"


def _slots(tmp_path: Path, *extra: str) -> LocalSlots:
    def launch_for(gpu: str, pool: str, config_json: str, devices: tuple[str, ...]) -> LaunchSpec:
        return LaunchSpec("", (*emulated_replica_argv(EMULATE_COMMAND, MODEL, gpu, config_json, 1.0), *extra))
    return LocalSlots(LocalActuator(tmp_path), launch_for, start_timeout_s=60)


def _port(url: str | None) -> int:
    assert url is not None
    return int(url.rsplit(":", 1)[1])


def test_a_replica_whose_port_another_process_took_before_it_listened_starts_again_on_another(tmp_path: Path) -> None:
    slots = _slots(tmp_path)
    slots.add_slot(SLOT, GPU, "chat", "{}")
    try:
        with socket.socket() as squatter:
            slots.start(SLOT, "chat", "{}", 0.0)
            taken = _port(slots.url(SLOT))
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", taken))  # before the emulator, which spends a second importing, gets to it
            squatter.listen()
            first = slots.slots[SLOT].process
            assert first is not None
            deadline = time.monotonic() + 60
            while not ((state := slots.slot_states()[0]).alive and state.healthy) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert state.alive and state.healthy, [p.read_text() for p in tmp_path.glob("*.log")]
            assert first.process.returncode == 2 and _port(slots.url(SLOT)) != taken and slots.error(SLOT) is None
    finally:
        slots.close()


def test_a_replica_that_exits_on_its_own_is_not_started_again(tmp_path: Path) -> None:
    slots = _slots(tmp_path, "--no-such-flag")
    slots.add_slot(SLOT, GPU, "chat", "{}")
    try:
        slots.start(SLOT, "chat", "{}", 0.0)
        first = slots.slots[SLOT].process
        assert first is not None
        first.process.wait(60)
        assert slots.error(SLOT) == f"exited with code 2 (see {first.log_path})"
        assert not slots.slot_states()[0].alive and slots.slots[SLOT].process is first
    finally:
        slots.close()


def test_the_external_controller_starts_a_replica_that_lost_its_port_again_on_another(tmp_path: Path) -> None:
    config = load_config(write_fleet_config(tmp_path, (("chat", 1, ("short-chat",)),), {"enabled": True, "mode": "external", "url": "http://127.0.0.1:1"}))
    service = ControllerService(config, tmp_path / "state.json", EMULATE_COMMAND, tmp_path / "replicas")
    record = SlotRecord(SLOT, "chat", GPU, config.pools[0].config_json, "starting", model=MODEL)
    try:
        with socket.socket() as squatter:
            service.slots[record.slot] = service._launch(record, "chat", record.config_json)
            taken, first = _port(service.slots[record.slot].url), service.slots[record.slot].pid
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            deadline = time.monotonic() + 60
            while record.slot not in service.healthy and time.monotonic() < deadline:
                service._probe_starting()
                time.sleep(0.1)
            assert record.slot in service.healthy, [p.read_text() for p in (tmp_path / "replicas").glob("*.log")]
            again = service.slots[record.slot]
            assert _port(again.url) != taken and again.pid != first and again.pid == service.processes[record.slot].process.pid
    finally:
        service.stop_replicas()
