"""A run's own checkpoint namespace, and the lease that lets one live driver at a time write it.

Jobs may share a ``checkpoint.path`` (every Tune trial of a base job that sets one does): each
run writes under ``<checkpoint root>/<run id>/`` (the id recorded in its run directory,
``orchestrator/run_dir.py``), and prunes, looks for its saved steps and resumes only there, so
no run ever reads, counts or deletes another's checkpoints. The namespace records the run
directory it belongs to (``owner.json``): a copy of that directory (same run id) is refused
rather than let two runs write one namespace, unless the namespace lies inside the copy (the
default root, copied along with it, is the copy's own).

Two drivers in one namespace (the same run directory resumed twice at once) would destroy it:
the first to take the namespace's lease (``lease.json`` in it, written through the checkpoint
storage, so it works on every storage a checkpoint does) holds it, refreshing it every
``refresh_s`` from a background thread; the second is refused before it starts. A lease whose
file the storage last saw written ``stale_s`` ago (its driver is gone, or cut off from the
storage that long), or whose driver's process is provably gone, is taken over. Storage has no
compare-and-set, so taking a lease is write, wait ``settle_s``, read back: of two drivers
racing, the one whose write was overwritten sees it and backs off. A lease read back absent or
unreadable (a network file system's passing ENOENT across a rename, a partial object) is
written again; only another driver's lease in it means it is lost, and a driver that finds its
lease lost (``check``, before each manifest) writes no more checkpoints.
"""

from __future__ import annotations

import contextlib
import enum
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
#: Names the run directory a namespace belongs to; written once, by its first driver.
OWNER_FILE = "owner.json"
#: Seconds between a holder's refreshes of its lease.
REFRESH_S = 30.0
#: A lease the storage last saw written this long ago is its holder's no more. Its age is read
#: on the storage's own clock (``_age_s``), never by comparing two hosts' clocks.
STALE_S = 180.0
#: Seconds between writing a lease and reading it back, for a racing writer's lease to land. A
#: local file is there once renamed; a write to a URI (an object store's PUT, a remote file
#: system) from another host can take seconds to land, so those wait longer. A race it misses
#: is caught by ``check`` before the next manifest.
SETTLE_S = 0.2
REMOTE_SETTLE_S = 2.0
#: Writes of this driver's lease that may read back absent or unreadable before it gives up.
WRITE_TRIES = 3


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
    """``namespace_root`` of the run directory ``run_dir``, its id read back (``read_run_id``).
    Raises ConfigError if ``run_dir`` is a copy of the run that owns it (``check_owner``)."""
    run_id = read_run_id(run_dir)
    root = namespace_root(job, run_dir, run_id)
    if run_id is not None:
        check_owner(CheckpointStorage(root), run_dir, run_id)
    return root


def check_owner(storage: CheckpointStorage, run_dir: Path, run_id: str) -> bool:
    """Whether the namespace in ``storage`` is to record ``run_dir`` as its owner (it names none,
    an unreadable one, or another directory that ``run_dir`` may succeed). Raises ConfigError
    if another run directory owns it and ``run_dir`` is a copy of that one (same run id): their
    checkpoints would overwrite and prune each other's. A namespace inside ``run_dir`` is its
    own whatever the file says: a copy of a run directory carries its default root along.
    Raises ConfigError naming the file if the storage fails."""
    mine = os.path.realpath(run_dir)
    try:
        owner = str(json.loads(storage.read_bytes(OWNER_FILE))["run_dir"])
    except FileNotFoundError:
        return True
    except (ValueError, TypeError, KeyError):  # written whole, so no owner's: ours from now on
        return True
    except OSError as err:
        raise ConfigError(f"checkpoint.path: cannot read {storage.location(OWNER_FILE)}: {type(err).__name__}: {err}") from None
    if owner == mine:
        return False
    if storage.is_local and os.path.realpath(storage.where).startswith(mine + os.sep):
        return True
    raise ConfigError(
        f"run directory {run_dir} is a copy of {owner} (run id {run_id}): both would write the checkpoints in "
        f"{storage.where} and prune each other's; start a new run with a new --run-dir instead (or, if {owner} was "
        f"moved here, delete {storage.location(OWNER_FILE)})"
    )


def _record_owner(storage: CheckpointStorage, run_dir: Path) -> None:
    text = json.dumps({"format": 1, "run_dir": os.path.realpath(run_dir)}, sort_keys=True).encode()
    try:
        storage.write_bytes(OWNER_FILE, text)
    except OSError as err:
        raise ConfigError(f"checkpoint.path: cannot write {storage.location(OWNER_FILE)}: {type(err).__name__}: {err}") from None


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


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease: ``token`` is its own (a driver may run several jobs, one per thread);
    ``pid_ns`` where its ``pid`` means something (``_pid_namespace``; None: unknown)."""

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

    def process_gone(self) -> bool:
        """Whether its process is certainly gone: it ran in this PID namespace (on this machine,
        since its boot: a host name is shared by containers that cannot see each other's
        processes) and no such pid is left."""
        if self.pid_ns is None or self.pid_ns != _pid_namespace() or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # someone else's process
            return False
        return False


class Unread(enum.Enum):
    """A lease read back as no driver's."""

    ABSENT = "absent"
    UNREADABLE = "unreadable"  # leases are written whole: a partial object, a garbled file


@dataclass(frozen=True)
class Held:
    """A lease as read from storage: its owner and the ``stale_s`` it was written with."""

    owner: LeaseOwner
    stale_s: float


class NamespaceLease:
    """The lease of the namespace ``root`` (a path or URI) for this driver (see the module doc).
    ``settle_s`` None: ``SETTLE_S`` for a local root, ``REMOTE_SETTLE_S`` for a URI."""

    def __init__(
        self, root: str, refresh_s: float = REFRESH_S, stale_s: float = STALE_S, settle_s: float | None = None
    ) -> None:
        self.storage = CheckpointStorage(root)
        self.owner = LeaseOwner.of_this_process()
        self.refresh_s, self.stale_s = refresh_s, stale_s
        self.settle_s = settle_s if settle_s is not None else SETTLE_S if self.storage.is_local else REMOTE_SETTLE_S
        self.where = self.storage.location(LEASE_FILE)
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._lost: str | None = None  # set once it is another driver's (or unrefreshed past stale_s)
        self.trouble: str | None = None  # the refresher's last failure; None since its last success

    def acquire(self) -> None:
        """Take the lease and start refreshing it. Raises NamespaceBusy if another live driver
        holds it (or takes it meanwhile), ConfigError naming the lease if the storage fails."""
        try:
            found = self._read()
            if isinstance(found, Held) and not self._mine(found):
                age = self._age_s()
                if not found.owner.process_gone() and (age is None or age <= found.stale_s):
                    raise self._busy(found, age)
            found = self._claim()
        except OSError as err:
            # A run starts only when its checkpoint storage answers: it would lose every checkpoint.
            raise ConfigError(f"checkpoint.path: cannot take the lease {self.where}: {type(err).__name__}: {err}") from None
        if isinstance(found, Held):
            raise self._busy(found, 0.0)  # written after this driver's
        if found is not None:
            raise ConfigError(
                f"checkpoint.path: cannot take the lease {self.where}: written {WRITE_TRIES} times, it read back {found.value}"
            )
        self._refresher = threading.Thread(target=self._refresh_until_stopped, name="ringleader-lease", daemon=True)
        self._refresher.start()

    @property
    def lost(self) -> str | None:
        """Why this driver's lease is no longer its own (found by ``check`` or the refresher), or None."""
        return self._lost

    def check(self) -> str | None:
        """None while this driver holds the lease; else why it may not write a manifest now:
        the lease is lost (another driver's, for good) or still absent or unreadable after
        ``WRITE_TRIES`` writes (this time only). Reads the lease (raises OSError if the storage
        fails): asked before each manifest is written."""
        if self._lost is None:
            found = self._renew(refresh=False)
            if isinstance(found, Held):
                self._lost = self._taken(found)
            elif found is not None:
                return f"the lease {self.where} read back {found.value} after {WRITE_TRIES} writes"
        return self._lost

    def release(self) -> None:
        """Stop refreshing and delete the lease if it is still this driver's. Storage errors are
        swallowed (it runs on the way out of the job, whose outcome is what to report): a lease
        left behind goes stale."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=self.refresh_s)
        try:
            if self._mine(self._read()):
                self.storage.delete_file(LEASE_FILE)
        except Exception:
            pass

    def _refresh_until_stopped(self) -> None:
        last_refresh = time.monotonic()
        while not self._stop.wait(self.refresh_s):
            try:
                found = self._renew(refresh=True)
            except Exception as err:  # any failure: a refresher that died would leave a live run's lease to go stale
                self.trouble = f"{type(err).__name__}: {err}"
            else:
                if isinstance(found, Held):
                    self._lost = self._taken(found)  # never write over the driver that took it
                    return
                self.trouble = None if found is None else f"it read back {found.value} after {WRITE_TRIES} writes"
            if self.trouble is None:
                last_refresh = time.monotonic()
            elif time.monotonic() - last_refresh > self.stale_s:
                # Past stale_s another driver may take it: the coordinator fails the job rather than write beside it.
                self._lost = (
                    f"the lease {self.where} of this run's checkpoints went unrefreshed for "
                    f"{time.monotonic() - last_refresh:.0f}s ({self.trouble}): another driver may take it"
                )
                return

    def _renew(self, refresh: bool) -> Held | Unread | None:
        """Read the lease: None while it is this driver's (written again if ``refresh``), else
        another driver's lease, or what was read back after ``_claim`` if it was absent or
        unreadable."""
        found = self._read()
        if isinstance(found, Unread):
            return self._claim()
        if not self._mine(found):
            return found
        if refresh:
            self._write()
        return None

    def _claim(self) -> Held | Unread | None:
        """Write this driver's lease and read it back after ``settle_s``, up to ``WRITE_TRIES``
        times while it reads back absent or unreadable. None once it reads back as this
        driver's; else another driver's lease (it won the race), or the last ``Unread``."""
        found: Held | Unread | None = None
        for _ in range(WRITE_TRIES):
            self._write()
            time.sleep(self.settle_s)
            found = self._read()
            if isinstance(found, Held):
                return None if self._mine(found) else found
        return found

    def _mine(self, found: Held | Unread | None) -> bool:
        return isinstance(found, Held) and found.owner.token == self.owner.token

    def _age_s(self) -> float | None:
        """Seconds since the lease file was last written, on the storage's clock: its
        modification time against that of a probe written now (the writer's clock and this
        host's may disagree by minutes; the storage's is one clock). None if the storage keeps
        no such times; infinite if the lease is gone."""
        written = self.storage.modified(LEASE_FILE)
        probe = f"clock-{self.owner.token}.probe"
        self.storage.write_bytes(probe, b"")
        try:
            now = self.storage.modified(probe)
        finally:
            self.storage.delete_file(probe)
        if written is None:
            return float("inf")
        return None if now is None else max(0.0, now - written)

    def _write(self) -> None:
        lease = {"format": 1, "owner": asdict(self.owner), "refreshed": time.time(), "stale_s": self.stale_s}
        self.storage.write_bytes(LEASE_FILE, json.dumps(lease, sort_keys=True).encode())

    def _read(self) -> Held | Unread:
        """The lease in storage, or why there is none. Raises OSError if the storage fails."""
        try:
            data: Any = json.loads(self.storage.read_bytes(LEASE_FILE))
            owner = data["owner"]
            pid_ns = owner.get("pid_ns")
            return Held(
                LeaseOwner(
                    str(owner["host"]), int(owner["pid"]), float(owner["started"]), str(owner["token"]),
                    None if pid_ns is None else str(pid_ns),
                ),
                float(data["stale_s"]),
            )
        except FileNotFoundError:
            return Unread.ABSENT
        except (ValueError, TypeError, KeyError, AttributeError):
            return Unread.UNREADABLE

    def _busy(self, held: Held, age: float | None) -> NamespaceBusy:
        written = "of unknown age" if age is None else f"written {age:.0f}s ago"
        return NamespaceBusy(
            f"checkpoint namespace {self.storage.where} is in use by another driver ({held.owner.describe()}, lease "
            f"{written}; {self.where}): two drivers writing one run's checkpoints would destroy them; wait for that "
            f"one to end, or delete the lease if its driver is gone (a lease not written for {held.stale_s:.0f}s is taken over)"
        )

    def _taken(self, held: Held) -> str:
        now = held.owner.describe()
        return f"the lease {self.where} of this run's checkpoints is no longer this driver's (now held by {now})"


@contextlib.contextmanager
def hold_namespace(job: JobConfig, run: RunDirectory) -> Iterator[NamespaceLease | None]:
    """Hold the lease of ``run``'s checkpoint namespace while the block runs (None, and no
    lease, when the job takes no checkpoints), the namespace recorded as ``run``'s. Raises on
    entry, having written nothing: ConfigError if ``run`` is a copy of the run directory that
    owns the namespace (``check_owner``) or the storage fails, NamespaceBusy if another live
    driver holds it."""
    if not job.checkpoint.enabled:
        yield None
        return
    lease = NamespaceLease(namespace_root(job, run.path, run.run_id))
    record = run.run_id is not None and check_owner(lease.storage, run.path, run.run_id)
    lease.acquire()
    try:
        if record:
            _record_owner(lease.storage, run.path)
        yield lease
    finally:
        lease.release()
