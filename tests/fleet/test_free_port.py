"""free_port hands out listenable ports that a client socket cannot take first."""

from __future__ import annotations

import socket
from pathlib import Path

from fleet.actuators.local import free_port


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
