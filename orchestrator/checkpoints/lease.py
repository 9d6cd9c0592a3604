"""The lease that lets one live driver at a time write a run's checkpoint namespace.

Two drivers in one namespace (the same run directory resumed twice at once) would destroy it:
the first to take the namespace's lease (``lease.json`` in it, written through the checkpoint
storage, so it works on every storage a checkpoint does) holds it, refreshing it every
``refresh_s`` from a background thread; another is refused before it starts. A lease whose
driver is certainly gone (its process gone from this PID namespace, or a lease of this very
process that no ``NamespaceLease`` here holds any more) is taken over at once; one its driver
certainly holds (this process's) refuses at once. Any other lease (a driver on another host,
or in another container) is watched: refreshed while watched, its driver is alive and this
one is refused; left unwritten until the storage last saw it written ``stale_s`` ago, its
driver is gone (or cut off from the storage that long) and it is taken over. The wait is
bounded by the lease's own ``stale_s`` (three minutes by default) and reported through
``on_wait``. Storage has no compare-and-set, so taking a lease is write, wait ``settle_s``,
read back: of two drivers racing, the one whose write was overwritten sees it and backs off.
A lease read back absent or unreadable (a network file system's passing ENOENT across a
rename, a partial object) is written again; only another driver's lease in it means it is
lost, and a driver that finds its lease lost (``check``, before each manifest) writes no
more checkpoints. A refresher that cannot write the lease for ``stale_s`` (a storage outage
that long) marks it lost too: another driver may have taken it, so the job fails rather than
write beside it. ``release`` deletes the lease under the lock every write of it takes, after
which none is written: a refresher's write slower than the release never brings it back.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from jobspec.fields import ConfigError
from orchestrator.checkpoints.lease_owner import LeaseOwner, Liveness, forget_lease, hold_lease
from workers.checkpoint.storage import CheckpointStorage

LEASE_FILE = "lease.json"
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
#: Most seconds between two reads of a lease being watched for its holder's refresh.
WATCH_POLL_S = 2.0
#: Most seconds ``release`` waits for a write of the lease in flight (a slow storage) to land
#: before deleting it; past that it leaves the lease, to go stale.
RELEASE_WAIT_S = 30.0


class NamespaceBusy(ConfigError):
    """Another live driver holds the checkpoint namespace's lease (the message names both)."""


class Unread(enum.Enum):
    """A lease read back as no driver's."""

    ABSENT = "absent"
    UNREADABLE = "unreadable"  # leases are written whole: a partial object, a garbled file


@dataclass(frozen=True)
class Held:
    """A lease as read from storage: its owner, when its writer's clock says it wrote it (a
    refresh changes it; compared with nothing but itself) and the ``refresh_s`` and ``stale_s``
    it was written with (a lease from before ``refresh_s`` was recorded: ``REFRESH_S``)."""

    owner: LeaseOwner
    refreshed: float
    refresh_s: float
    stale_s: float


class _Released(Exception):
    """Raised instead of writing the lease once ``release`` has begun."""


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
        self._writing = threading.Lock()  # every write of the lease, and release's delete
        self._refresher: threading.Thread | None = None
        self._lost: str | None = None  # set once it is another driver's (or unrefreshed past stale_s)
        self.trouble: str | None = None  # the refresher's last failure; None since its last success

    def acquire(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lease and start refreshing it. A lease whose driver may be alive is watched
        first, for at most its ``stale_s`` (``_wait_out``; ``on_wait`` is told why it waits).
        Raises NamespaceBusy if another live driver holds it (or takes it meanwhile),
        ConfigError naming the lease if the storage fails."""
        hold_lease(self.owner.token)  # from now on a lease of this process with this token is live
        try:
            self._take(on_wait)
        except BaseException:
            forget_lease(self.owner.token)
            raise
        self._refresher = threading.Thread(target=self._refresh_until_stopped, name="ringleader-lease", daemon=True)
        self._refresher.start()

    def _take(self, on_wait: Callable[[str], None] | None) -> None:
        try:
            found = self._read()
            if isinstance(found, Held) and not self._mine(found):
                liveness = found.owner.liveness()
                if liveness is Liveness.ALIVE:
                    # Held here: its refresher writes it unless it failed for stale_s (then it has marked itself lost).
                    age = self._age_s()
                    if age is None or age <= found.stale_s:
                        raise self._busy(found, "held by a driver in this very process")
                elif liveness is Liveness.UNKNOWN:
                    self._wait_out(found, on_wait)
            found = self._claim()
        except OSError as err:
            # A run starts only when its checkpoint storage answers: it would lose every checkpoint.
            raise ConfigError(f"checkpoint.path: cannot take the lease {self.where}: {type(err).__name__}: {err}") from None
        if isinstance(found, Held):
            raise self._busy(found, "written after this driver's")
        if found is not None:
            raise ConfigError(
                f"checkpoint.path: cannot take the lease {self.where}: written {WRITE_TRIES} times, it read back {found.value}"
            )

    def _wait_out(self, held: Held, on_wait: Callable[[str], None] | None) -> None:
        """Return once ``held`` has gone unwritten for its ``stale_s`` (its age on the storage's
        clock at first, then this host's monotonic clock: never two hosts' clocks compared), or
        was deleted or left unreadable; raise NamespaceBusy as soon as its driver writes it
        again (alive). A live driver refreshes every ``refresh_s``, so one is refused within
        about that; a gone one is waited out for at most ``stale_s``."""
        age = self._age_s()
        left = held.stale_s - (0.0 if age is None else age)  # no times kept: watch it a whole stale_s
        if left <= 0:
            return
        if on_wait is not None:
            written = "of unknown age" if age is None else f"last written {age:.0f}s ago"
            on_wait(
                f"the lease {self.where} of this run's checkpoints is held by {held.owner.describe()} ({written}); "
                f"waiting up to {left:.0f}s: taken over unless its driver refreshes it meanwhile"
            )
        began = time.monotonic()
        poll = max(0.01, min(WATCH_POLL_S, held.refresh_s / 4))
        while (remaining := began + left - time.monotonic()) > 0:
            time.sleep(min(poll, remaining))
            now = self._read()
            if now != held:
                if isinstance(now, Held) and now.owner.liveness() is not Liveness.GONE:
                    raise self._busy(now, f"written again while this driver waited {time.monotonic() - began:.0f}s")
                return

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
        """Stop refreshing and delete the lease if it is still this driver's; no write of it
        follows (a refresher's write in flight lands first: waited for up to ``RELEASE_WAIT_S``,
        past which the lease is left to go stale). Storage errors are swallowed (it runs on the
        way out of the job, whose outcome is what to report): a lease left behind goes stale,
        and one left in this process is nobody's at once."""
        self._stop.set()
        forget_lease(self.owner.token)
        if not self._writing.acquire(timeout=RELEASE_WAIT_S):
            return
        try:
            if self._mine(self._read()):
                self.storage.delete_file(LEASE_FILE)
        except Exception:
            pass
        finally:
            self._writing.release()

    def _refresh_until_stopped(self) -> None:
        last_refresh = time.monotonic()
        while not self._stop.wait(self.refresh_s):
            try:
                found = self._renew(refresh=True)
            except _Released:
                return
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
        """Write this driver's lease; raises ``_Released`` instead once ``release`` began (the
        check and the write under the lock release deletes under: none lands after it)."""
        lease = {
            "format": 1, "owner": asdict(self.owner), "refreshed": time.time(), "refresh_s": self.refresh_s,
            "stale_s": self.stale_s,
        }
        with self._writing:
            if self._stop.is_set():
                raise _Released()
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
                float(data["refreshed"]),
                float(data.get("refresh_s", REFRESH_S)),
                float(data["stale_s"]),
            )
        except FileNotFoundError:
            return Unread.ABSENT
        except (ValueError, TypeError, KeyError, AttributeError):
            return Unread.UNREADABLE

    def _busy(self, held: Held, how: str) -> NamespaceBusy:
        return NamespaceBusy(
            f"checkpoint namespace {self.storage.where} is in use by another driver ({held.owner.describe()}, lease {how}; "
            f"{self.where}): two drivers writing one run's checkpoints would destroy them; let that driver end (or stop "
            f"it) and run this again; a lease its driver stops refreshing is taken over {held.stale_s:.0f}s after its "
            f"last write, and deleting {self.where} frees it at once if you are sure its driver is gone"
        )

    def _taken(self, held: Held) -> str:
        now = held.owner.describe()
        return f"the lease {self.where} of this run's checkpoints is no longer this driver's (now held by {now})"
