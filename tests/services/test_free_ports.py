"""The harness's free ports: never one handed out twice by a process, never from the kernel's ephemeral
range (where any outgoing connection's source port could take it before the server binds it)."""

from __future__ import annotations

import socket

from harness.servers import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", ports[-1] + 1))  # the walk's next port, now taken: it is passed over
        assert free_port() != ports[-1] + 1
