"""The rendezvous store the workers meet at, one key prefix per generation: a TCPStore served
by the driver, in its process or in a child process of its own (``orchestrator/store_process.py``)."""

from __future__ import annotations

import secrets
from datetime import timedelta

import torch.distributed as dist

from orchestrator.store_process import StoreProcess, StoreProcessError, listening_store
from workers.claims import CountingStore


class RendezvousStore:
    """A TCPStore the driver serves, so no worker is a single point of failure: in its own
    process, or (``own_process``) in a child process, so the workers' claim traffic does not
    take the driver's CPU (``close`` stops it).
    It listens on ``host`` only, the address workers reach the driver at (the driver's Ray node
    IP on a cluster), not on every interface. Every key lives under ``namespace``, a random
    secret per job that workers receive through Ray (``JoinRequest``): a stray client that
    reaches the port can neither read nor forge a shard claim. Each process group formed
    through it uses a fresh key prefix (its generation); shard claims live under the current
    generation's prefix (``claims``)."""

    #: The current generation's view of the store, where shard claims live (set by next_prefix).
    claims: CountingStore

    def __init__(self, host: str, timeout_s: float, own_process: bool = False) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.namespace = f"{secrets.token_hex(16)}/"
        self.generation = 0
        self.process: StoreProcess | None = None
        self._client: dist.Store | None = None
        if own_process:
            # Started now, connected to on first use: it loads while the workers start.
            self.process = StoreProcess(host, timeout_s)
        else:
            server, self._port = listening_store(host, timeout_s)
            self._client = dist.PrefixStore(self.namespace, server)  # the server lives as long as this object

    @property
    def port(self) -> int:
        return self.process.port if self.process is not None else self._port

    @property
    def _store(self) -> dist.Store:
        if self._client is None:
            assert self.process is not None
            client = dist.TCPStore(self.host, self.process.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
            self._client = dist.PrefixStore(self.namespace, client)
        return self._client

    def server_cpu_s(self) -> float | None:
        """CPU seconds the server process used so far; None when it is the driver's own (or
        the system does not say)."""
        return self.process.cpu_s() if self.process is not None else None

    def check_alive(self) -> None:
        """Raise StoreProcessError if the server process has died (the workers' store errors
        then come from there, not from their own code)."""
        status = self.process.exit_status() if self.process is not None else None
        if status is not None:
            raise StoreProcessError(f"the rendezvous store's process (pid {self.process.pid}) died with status {status}")

    def close(self) -> None:
        """Stop the server process, if it has one."""
        if self.process is not None:
            self.process.close()

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
