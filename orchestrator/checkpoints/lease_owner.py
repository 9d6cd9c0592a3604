"""Who holds a checkpoint namespace's lease, and what this process can know of whether it is alive.

A lease names its driver's host, pid and PID namespace, and a token of its own (a driver may run
several jobs, one per thread). This process knows for certain of two drivers only: itself (a
lease of this process is live exactly while a ``NamespaceLease`` here holds its token: the
registry ``hold_lease``/``forget_lease`` keeps) and a process gone from its own PID namespace.
Of any other it knows nothing (another host, another container, a pid alive but perhaps reused):
its lease must be watched for a refresh (``orchestrator/checkpoints/lease.py``).
"""

from __future__ import annotations

import enum
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

#: Tokens of the leases ``NamespaceLease`` objects in this process hold (taking or taken, not yet
#: released). A lease naming this process whose token is not here was left behind (an earlier
#: driver in this process whose release could not delete it) and is nobody's.
_HELD_HERE: set[str] = set()
_HELD_LOCK = threading.Lock()


def hold_lease(token: str) -> None:
    """Record that a lease of this process with ``token`` is being taken or held."""
    with _HELD_LOCK:
        _HELD_HERE.add(token)


def forget_lease(token: str) -> None:
    """Record that the lease with ``token`` is held here no more (released, or never taken)."""
    with _HELD_LOCK:
        _HELD_HERE.discard(token)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace: the machine's boot and the namespace's inode. Equal, two
    processes see each other's pids; None where the system does not say (no ``/proc``)."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        inode = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{inode.st_dev}:{inode.st_ino}" if boot else None


class Liveness(enum.Enum):
    """What this process knows of a lease's driver."""

    ALIVE = "alive"  # this process, holding the lease
    GONE = "gone"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease: ``token`` is its own; ``pid_ns`` where its ``pid`` means something
    (``_pid_namespace``; None: unknown)."""

    host: str
    pid: int
    started: float
    token: str
    pid_ns: str | None = None

    @classmethod
    def of_this_process(cls) -> LeaseOwner:
        return cls(socket.gethostname(), os.getpid(), time.time(), secrets.token_hex(8), _pid_namespace())

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {datetime.fromtimestamp(self.started, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"

    def liveness(self) -> Liveness:
        """Known only for a driver in this PID namespace (on this machine, since its boot: a
        host name is shared by containers that cannot see each other's processes): this
        process is ALIVE while it holds the lease's token and GONE once it does not; another
        process is GONE once no such pid is left. Anything else is UNKNOWN (a live pid may be
        another process's by now)."""
        if self.pid_ns is None or self.pid_ns != _pid_namespace() or self.host != socket.gethostname():
            return Liveness.UNKNOWN
        if self.pid == os.getpid():
            with _HELD_LOCK:
                return Liveness.ALIVE if self.token in _HELD_HERE else Liveness.GONE
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return Liveness.GONE
        except PermissionError:  # someone else's process
            return Liveness.UNKNOWN
        return Liveness.UNKNOWN
