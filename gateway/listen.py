"""The address a gateway or a controller will listen on, held while its replicas start."""

from __future__ import annotations

import socket


def hold_address(host: str, port: int) -> socket.socket | None:
    """``host:port`` bound but not listening, from before the replicas start until the server listens there:
    an address in use fails ``polymorph serve`` or ``polymorph controller`` at once, not once the engines
    have loaded (40 s for vLLM's CPU build here, minutes for a large model), and meanwhile no replica
    takes the port (the actuators' port walk, fleet.actuators.local.free_port, passes over a bound one).
    Both this socket and the listener set SO_REUSEADDR, which lets the listener bind beside it. None for
    port 0 (any port)."""
    if port == 0:
        return None
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    held = socket.socket(family, kind, proto)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        held.bind(address)
    except OSError:
        held.close()
        raise
    return held
