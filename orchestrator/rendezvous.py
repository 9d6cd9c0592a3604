"""The driver-hosted rendezvous store the workers meet at, one key prefix per generation."""

from __future__ import annotations

import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

from workers.claims import CountingStore


class RendezvousStore:
    """A TCPStore in the driver process, so no worker is a single point of failure.

    It listens on ``host`` only, the address workers reach the driver at (the driver's Ray node
    IP on a cluster), not on every interface. Every key lives under ``namespace``, a random
    secret per job that workers receive through Ray (``JoinRequest``): a stray client that
    reaches the port can neither read nor forge a shard claim. Each process group formed
    through it uses a fresh key prefix (its generation); shard claims live under the current
    generation's prefix (``claims``)."""

    #: The current generation's view of the store, where shard claims live (set by next_prefix).
    claims: CountingStore

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host = host
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        # Bound here and handed to the store: TCPStore alone would listen on every interface.
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(1024)
        self.port = listener.getsockname()[1]
        server = dist.TCPStore(
            host, self.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
            # The store owns the descriptor from here on (and closes it): detach it from the
            # Python socket, or both would close the same number.
            master_listen_fd=listener.detach(),
        )
        self.namespace = f"{secrets.token_hex(16)}/"
        self._server = server  # the server lives as long as this object
        self._store = dist.PrefixStore(self.namespace, server)
        self.generation = 0

    def read(self, key: str) -> str | None:
        """The value at ``key`` (outside any generation), or None if it is not set; no wait."""
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()

    def next_prefix(self) -> str:
        """Start the next generation; returns its key prefix."""
        self.generation += 1
        prefix = f"gen{self.generation}/"
        self.claims = CountingStore(dist.PrefixStore(prefix, self._store))
        return prefix
