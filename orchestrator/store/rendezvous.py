"""The rendezvous store the workers meet at, one key prefix per generation: a TCPStore served
by the driver, in its process or in a child process of its own (``orchestrator/store/server_process.py``).

Its failures end the job (``StoreFailed``, naming the store's address and the error): the
driver's own operations on it go through ``call`` (bounded: a store that is alive but stopped
answering is named too) and ``named_errors``, and ``check_alive`` sees its process die. It is
not restarted: the claims of the steps in flight would be lost with it, and it is
the driver's own child, so its death means the driver's host is in trouble."""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from jobspec.fields import first_line
from orchestrator.errors import JobFailed, StoreFailed
from orchestrator.store.server_process import START_TIMEOUT_S, StoreProcess, StoreProcessError, listening_store
from workers.step.claims import ClaimStores, CountingStore

T = TypeVar("T")
#: Beyond the store's own timeout, how long a driver call may take before the store is named as
#: not answering: torch's client waits on a server that is alive but wedged (stopped, swapped
#: out) past its timeout, for minutes.
STORE_CALL_SLACK_S = 2.0


class _Caller:
    """One daemon thread that makes the driver's calls to the store, so each can be waited on
    with a deadline. A daemon thread, not an executor: a call wedged in torch must not hold
    up the interpreter's exit; calls after a wedged one queue behind it and time out too."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ringleader-store-calls", daemon=True).start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            operation, future = call
            try:
                future.set_result(operation())
            except BaseException as err:  # handed to the caller, who waits on the future
                future.set_exception(err)

    def run(self, operation: Callable[[], T], timeout_s: float) -> T:
        """``operation()``'s result (or its exception); FutureTimeout after ``timeout_s``."""
        future: Future[T] = Future()
        self._calls.put((operation, future))
        return future.result(timeout=timeout_s)

    def stop(self) -> None:
        """End the thread once the calls queued before are done."""
        self._calls.put(None)


class RendezvousStore:
    """A TCPStore the driver serves, so no worker is a single point of failure: in its own
    process, or (``own_process``) in a child process, so the workers' claim traffic does not
    take the driver's CPU (``close`` stops it).
    It listens on ``host`` only, the address workers reach the driver at (the driver's Ray node
    IP on a cluster), not on every interface. Every key lives under ``namespace``, a random
    secret per job that workers receive through Ray (``JoinRequest``): a stray client that
    reaches the port can neither read nor forge a shard claim. Each process group formed
    through it uses a fresh key prefix (its generation); shard claims live under the current
    generation's prefix (``claims``), spread over ``claim_stores`` stores: this one and
    ``claim_stores - 1`` more, served the same way (``claim_ports``; ``workers/step/claims.py``)."""

    #: The current generation's view of the stores where shard claims live (set by next_prefix).
    claims: ClaimStores

    def __init__(self, host: str, timeout_s: float, own_process: bool = False, claim_stores: int = 1) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.namespace = f"{secrets.token_hex(16)}/"
        self.generation = 0
        self.process: StoreProcess | None = None
        self._client: dist.Store | None = None
        self._claim_clients: list[dist.Store] = []
        self._caller: _Caller | None = None
        # The further stores claims are spread over: processes, or servers of this process.
        self.claim_processes: list[StoreProcess] = []
        self._claim_servers: list[tuple[dist.TCPStore, int]] = []
        if own_process:
            # Started now, connected to on first use: they load while the workers start.
            self.process = StoreProcess(host, timeout_s)
            try:
                for number in range(1, claim_stores):
                    self.claim_processes.append(StoreProcess(host, timeout_s, f"claim store {number}"))
            except BaseException:
                self.close()  # those already started, stopped by PID
                raise
        else:
            server, self._port = listening_store(host, timeout_s)
            self._client = dist.PrefixStore(self.namespace, server)  # the server lives as long as this object
            self._claim_servers = [listening_store(host, timeout_s) for _ in range(claim_stores - 1)]

    @property
    def port(self) -> int:
        return self.process.port if self.process is not None else self._port

    @property
    def claim_ports(self) -> tuple[int, ...]:
        """The ports of the stores claims are spread over besides this one (waits for their
        processes to listen, as ``port`` does)."""
        return tuple(p.port for p in self.claim_processes) + tuple(port for _, port in self._claim_servers)

    def _connect(self, port: int) -> dist.Store:
        """A client of the server on ``port``, its keys under the job's namespace."""
        client = dist.TCPStore(self.host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(self.namespace, client)

    def _claim_stores(self) -> list[dist.Store]:
        if not self._claim_clients:
            self._claim_clients = [self._connect(port) for port in self.claim_ports]
        return self._claim_clients

    @property
    def _store(self) -> dist.Store:
        if self._client is None:
            assert self.process is not None
            self._client = self._connect(self.process.port)
        return self._client

    def server_cpu_s(self) -> float | None:
        """CPU seconds the server processes (this store's and the further claim stores') used
        so far; None when they are the driver's own (or the system does not say)."""
        if self.process is None:
            return None
        used = [p.cpu_s() for p in (self.process, *self.claim_processes)]
        return None if None in used else sum(u for u in used if u is not None)

    @property
    def name(self) -> str:
        """The store as messages name it: its address (the port once it listens)."""
        port = self._port if self.process is None else self.process.known_port
        named = f"the job's store (rendezvous and shard claims) at {self.host}:{port if port is not None else '?'}"
        further = [p.known_port for p in self.claim_processes] or [port for _, port in self._claim_servers]
        if further:  # its errors may come from any of them
            named += f" and its claim stores at ports {', '.join('?' if p is None else str(p) for p in further)}"
        return named

    def check_alive(self) -> None:
        """Raise StoreProcessError if the server process has ended (the workers' store errors
        then come from there, not from their own code). A ``waitpid`` that does not block: the
        controller calls it every turn, so a dead store is named even while nothing uses it."""
        if self.process is None:
            return
        named = [(self.name, self.process)] + [
            (f"the job's {p.role} at {self.host}:{p.known_port or '?'}", p) for p in self.claim_processes
        ]
        for name, process in named:
            status = process.exit_status()
            if status is not None:
                how = f"was killed by signal {-status}"
                if status >= 0:  # it ended itself: its last line says why (a killed one's may be any warning)
                    said = process.last_words().splitlines()
                    how = f"exited with status {status}" + (f": {said[-1]}" if said else "")
                raise StoreProcessError(f"{name} died: its process (pid {process.pid}) {how}")

    @contextlib.contextmanager
    def named_errors(self, doing: str) -> Iterator[None]:
        """Turn a store error raised inside (torch's are RuntimeErrors: DistNetworkError,
        DistStoreError) into StoreFailed naming the store, what the driver was ``doing`` and the
        error's first line; StoreProcessError if the store's process has died meanwhile."""
        try:
            yield
        except JobFailed:
            raise
        except RuntimeError as err:
            self.check_alive()
            raise StoreFailed(f"{self.name} failed {doing}: {type(err).__name__}: {first_line(err)}") from err

    def call(self, doing: str, operation: Callable[..., T], *args: Any, wait_s: float | None = None) -> T:
        """``operation(*args)``, the driver's own use of the store, within ``wait_s`` (default
        the store's timeout) plus ``STORE_CALL_SLACK_S``. Raises StoreFailed naming the store
        and what it was ``doing`` if it failed, died or did not answer in time
        (StoreProcessError if its process has died)."""
        if self._caller is None:
            self._caller = _Caller()
        deadline_s = (self.timeout_s if wait_s is None else wait_s) + STORE_CALL_SLACK_S
        with self.named_errors(doing):
            try:
                return self._caller.run(lambda: operation(*args), deadline_s)
            except FutureTimeout:
                self.check_alive()
                raise StoreFailed(f"{self.name} did not answer within {deadline_s:.0f}s {doing}") from None

    def close(self) -> None:
        """Stop the server processes, if it has them, and the thread that calls them."""
        if self._caller is not None:
            self._caller.stop()
        for process in ([self.process] if self.process is not None else []) + self.claim_processes:
            process.close()

    def read(self, key: str) -> str | None:
        """The value at ``key`` (outside any generation), or None if it is not set; no wait.
        Raises StoreFailed."""
        def get() -> str | None:
            return self._store.get(key).decode() if self._store.check([key]) else None

        return self.call(f"reading {key}", get)

    def next_prefix(self) -> str:
        """Start the next generation; returns its key prefix. Raises StoreFailed (the first
        use connects to the store's process)."""
        self.generation += 1
        prefix = f"gen{self.generation}/"
        # The first use waits for the store's process to listen (it imports torch first).
        connect_s = self.timeout_s + (START_TIMEOUT_S if self._client is None else 0.0)
        self.claims = self.call(
            "connecting",
            lambda: ClaimStores([CountingStore(dist.PrefixStore(prefix, s)) for s in [self._store, *self._claim_stores()]]),
            wait_s=connect_s,
        )
        return prefix


def driver_store(timeout_s: float, claim_stores: int = 1) -> RendezvousStore:
    """The job's rendezvous store, on this (the driver's) Ray node's address, served by a child
    process of the driver, shard claims spread over it and ``claim_stores - 1`` more such
    processes (``close`` it when the job ends)."""
    import ray  # here only: the store, and the driver's modules above it, load without Ray

    return RendezvousStore(ray.util.get_node_ip_address(), timeout_s, own_process=True, claim_stores=claim_stores)
