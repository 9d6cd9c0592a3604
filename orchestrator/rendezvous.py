"""The driver-hosted rendezvous store the workers meet at, one key prefix per generation."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class RendezvousStore:
    """A TCPStore in the driver process, so no worker is a single point of failure.

    Each process group formed through it uses a fresh key prefix (its generation); shard claims
    live under the current generation's prefix (``claims``). ``host`` is the address workers
    reach the driver at (the driver's Ray node IP on a cluster)."""

    #: The current generation's view of the store, where shard claims live (set by next_prefix).
    claims: dist.Store

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host = host
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.port = self._store.port
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
        self.claims = dist.PrefixStore(prefix, self._store)
        return prefix
