"""A free TCP port on this machine, for a torchrun or accelerate launch's rendezvous."""

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
