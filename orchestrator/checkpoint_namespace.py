"""A run's own checkpoint namespace, and the lease that lets one live driver at a time write it.

Jobs may share a ``checkpoint.path`` (every Tune trial of a base job that sets one does): each
run writes under ``<checkpoint root>/<run id>/`` (the id recorded in its run directory,
``orchestrator/run_dir.py``), and prunes, looks for its saved steps and resumes only there, so
no run ever reads, counts or deletes another's checkpoints. Two drivers in one namespace (the
same run directory resumed twice at once) would: the first to take the namespace's lease
(``lease.json`` in it, written through the checkpoint storage, so it works on every storage a
checkpoint does) holds it, refreshing it every ``refresh_s`` from a background thread; the
second is refused before it starts. A lease not refreshed for ``stale_s`` (its driver is gone,
or cut off from the storage that long), or whose driver's process is gone from this host, is
taken over. Storage has no compare-and-set, so taking a lease is write, wait ``settle_s``, read
back: of two drivers racing, the one whose write was overwritten sees it and backs off; a
driver that finds its lease taken later (``check``) writes no more checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.run_dir import RunDirectory, read_run_id
from workers.checkpoint_storage import CheckpointStorage, absolute_root, sub_root

LEASE_FILE = "lease.json"
#: Seconds between a holder's refreshes of its lease.
REFRESH_S = 30.0
#: A lease not refreshed for this long is its holder's no more. Compared with the holder's
#: clock (the time it wrote), so it is generous beside clock skew between hosts.
STALE_S = 180.0
#: Seconds between writing a lease and reading it back, for a racing writer's lease to land
#: (a race it misses is caught by ``check`` before the next manifest).
SETTLE_S = 0.2


class NamespaceBusy(ConfigError):
    """Another live driver holds the checkpoint namespace's lease (the message names both)."""


def namespace_root(job: JobConfig, run_dir: Path, run_id: str | None) -> str:
    """Where the run ``run_id`` keeps its checkpoints, absolute: ``<root>/<run id>``, the root
    ``checkpoint.path`` or ``<run dir>/checkpoints``. ``run_id`` None: a run directory made
    before run ids, whose checkpoints are flat under the root; it reads and goes on writing
    them there, so it still resumes (other runs' namespaces are directories not named
    ``step-N``, which it neither lists nor prunes)."""
    root = absolute_root(job.checkpoint.path or str(run_dir / "checkpoints"))
    return root if run_id is None else sub_root(root, run_id)


def run_namespace(job: JobConfig, run_dir: Path) -> str:
    """``namespace_root`` of the run directory ``run_dir``, its id read back (``read_run_id``)."""
    return namespace_root(job, run_dir, read_run_id(run_dir))


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease: ``token`` is its own (a driver may run several jobs, one per thread)."""

    host: str
    pid: int
    started: float
    token: str

    @classmethod
    def of_this_process(cls) -> LeaseOwner:
        return cls(socket.gethostname(), os.getpid(), time.time(), secrets.token_hex(8))

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {datetime.fromtimestamp(self.started, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"

    def process_gone(self) -> bool:
        """Whether its process is certainly gone: it ran on this host and no such pid is left."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # someone else's process
            return False
        return False


@dataclass(frozen=True)
class Held:
    """A lease as read from storage."""

    owner: LeaseOwner
    refreshed: float
    stale_s: float

    def age_s(self) -> float:
        return max(0.0, time.time() - self.refreshed)

    def live(self) -> bool:
        return self.age_s() <= self.stale_s and not self.owner.process_gone()


class NamespaceLease:
    """The lease of the namespace ``root`` (a path or URI) for this driver (see the module doc)."""

    def __init__(self, root: str, refresh_s: float = REFRESH_S, stale_s: float = STALE_S, settle_s: float = SETTLE_S) -> None:
        self.storage = CheckpointStorage(root)
        self.owner = LeaseOwner.of_this_process()
        self.refresh_s, self.stale_s, self.settle_s = refresh_s, stale_s, settle_s
        self.where = self.storage.location(LEASE_FILE)
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._lost: str | None = None  # set by the refresher when it finds the lease taken

    def acquire(self) -> None:
        """Take the lease and start refreshing it. Raises NamespaceBusy if another live driver
        holds it (or takes it meanwhile), ConfigError naming the lease if the storage fails."""
        try:
            held = self._read()
            if held is not None and held.owner.token != self.owner.token and held.live():
                raise self._busy(held)
            self._write()
            time.sleep(self.settle_s)
            held = self._read()
        except OSError as err:
            # A run starts only when its checkpoint storage answers: it would lose every checkpoint.
            raise ConfigError(f"checkpoint.path: cannot take the lease {self.where}: {type(err).__name__}: {err}") from None
        if held is None or held.owner.token != self.owner.token:
            raise self._busy(held)
        self._refresher = threading.Thread(target=self._refresh_until_stopped, name="ringleader-lease", daemon=True)
        self._refresher.start()

    @property
    def lost(self) -> str | None:
        """Why this driver's lease is no longer its own (found by ``check`` or the refresher), or None."""
        return self._lost

    def check(self) -> str | None:
        """None while this driver holds the lease; else why not (who took it). Reads the lease
        (raises OSError if the storage fails): asked before each manifest is written."""
        if self._lost is None:
            held = self._read()
            if held is None or held.owner.token != self.owner.token:
                self._lost = self._taken(held)
        return self._lost

    def release(self) -> None:
        """Stop refreshing and delete the lease if it is still this driver's. Storage errors are
        swallowed: a lease left behind goes stale."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=self.refresh_s)
        try:
            held = self._read()
            if held is not None and held.owner.token == self.owner.token:
                self.storage.delete_file(LEASE_FILE)
        except OSError:
            pass

    def _refresh_until_stopped(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                held = self._read()
                if held is None or held.owner.token != self.owner.token:
                    self._lost = self._taken(held)  # never write over the driver that took it
                    return
                self._write()
            except OSError:
                pass  # storage trouble: tried again next time; past stale_s the lease may be taken

    def _write(self) -> None:
        lease = {"format": 1, "owner": asdict(self.owner), "refreshed": time.time(), "stale_s": self.stale_s}
        self.storage.write_bytes(LEASE_FILE, json.dumps(lease, sort_keys=True).encode())

    def _read(self) -> Held | None:
        """The lease in storage; None if there is none, or if it is unreadable as one (every
        lease is written whole, so such a file is no driver's)."""
        try:
            data: Any = json.loads(self.storage.read_bytes(LEASE_FILE))
            owner = data["owner"]
            return Held(
                LeaseOwner(str(owner["host"]), int(owner["pid"]), float(owner["started"]), str(owner["token"])),
                float(data["refreshed"]),
                float(data["stale_s"]),
            )
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError):
            return None

    def _busy(self, held: Held | None) -> NamespaceBusy:
        who = f"{held.owner.describe()}, lease refreshed {held.age_s():.0f}s ago" if held else "its lease changed hands"
        return NamespaceBusy(
            f"checkpoint namespace {self.storage.where} is in use by another driver ({who}; {self.where}): "
            "two drivers writing one run's checkpoints would destroy them; wait for that one to end, or delete "
            f"the lease if its driver is gone (a lease not refreshed for {self.stale_s:.0f}s is taken over)"
        )

    def _taken(self, held: Held | None) -> str:
        now = f"now held by {held.owner.describe()}" if held else "it is gone"
        return f"the lease {self.where} of this run's checkpoints is no longer this driver's ({now})"


@contextlib.contextmanager
def hold_namespace(job: JobConfig, run: RunDirectory) -> Iterator[NamespaceLease | None]:
    """Hold the lease of ``run``'s checkpoint namespace while the block runs (None, and no
    lease, when the job takes no checkpoints). Raises NamespaceBusy on entry if another live
    driver holds it."""
    if not job.checkpoint.enabled:
        yield None
        return
    lease = NamespaceLease(namespace_root(job, run.path, run.run_id))
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
