"""Files that say, by a lock, whether a live process uses them.

``held_file`` makes a file (or joins the one already there) and holds a shared ``flock`` on it
while in use; the last holder out removes it. ``remove_unheld`` removes the files nobody holds.
The kernel drops a dead process's locks, SIGKILL included, so a file nobody holds is one a
killed process left and nobody will read. ``ringleader submit`` ships its ``--set`` values in
such a file (``orchestrator/commands/submit.py``). POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: How long ``held_file`` waits for a file another process is removing (held exclusively
#: for just its unlink) to be gone; only a process stopped mid-removal makes it wait that long.
JOIN_WAIT_S = 10.0
#: How often, and how far apart, a holder on its way out tries to take a file for removal:
#: another holder leaving at the same instant refuses its first try (as its own was refused).
REMOVE_TRIES = 5
REMOVE_RETRY_S = 0.02


@contextlib.contextmanager
def held_file(path: Path, content: bytes) -> Iterator[Path]:
    """``path`` holding ``content`` (private to its owner), held until exit, then removed
    unless another process holds it too (the last one out removes it; failures included;
    two leaving at the same instant each try ``REMOVE_TRIES`` times, so one of them does).
    Processes that ask for the same path share one file, so its name must say its content
    (a hash of it): a file found there is taken as is. A reader never sees it partial: it
    is written whole under a temporary name first. Raises OSError if it cannot be made
    (TimeoutError if another process keeps it held for removal past ``JOIN_WAIT_S``)."""
    fd = _hold(path, content)
    try:
        yield path
    finally:
        _remove_if_unheld(path, fd)


def remove_unheld(directory: Path, pattern: str) -> None:
    """Remove the files in ``directory`` matching ``pattern`` (a glob) that no process holds;
    those it cannot remove (a read-only directory) stay."""
    for path in directory.glob(pattern):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile, or not ours to read
            continue
        with contextlib.suppress(OSError):
            _remove_if_unheld(path, fd)


def _hold(path: Path, content: bytes) -> int:
    """A descriptor of the file at ``path``, under a shared lock: the one there, else a new one."""
    deadline = time.monotonic() + JOIN_WAIT_S
    while True:
        try:
            fd: int | None = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = _create(path, content)
        else:
            # Refused while its last holder removes it; after the lock it may be gone already.
            if not (_lock(fd, fcntl.LOCK_SH) and _is_at(fd, path)):
                os.close(fd)
                fd = None
        if fd is not None:
            return fd
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was being removed for over {JOIN_WAIT_S:g}s")
        time.sleep(0.05)


def _create(path: Path, content: bytes) -> int | None:
    """``content`` written, fsynced and locked under a temporary name (which starts with
    ``path``'s: whoever matches those names matches it), then linked to ``path``; its
    descriptor, or None if another process made ``path`` first (join that one) or a
    ``remove_unheld`` took the temporary file before it was locked."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        if not _lock(fd, fcntl.LOCK_SH):
            os.close(fd)
            return None
        with open(fd, "wb", closefd=False) as handle:
            handle.write(content)
            handle.flush()
            os.fsync(fd)
        os.link(temporary, path)  # unlike a rename, never replaces a file another process holds
    except (FileExistsError, FileNotFoundError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        Path(temporary).unlink(missing_ok=True)
    return fd


def _remove_if_unheld(path: Path, fd: int) -> None:
    """Remove ``path`` if no other process holds it (``fd``: an open descriptor of it, closed
    here). An exclusive lock granted means nobody else holds it, and nobody can take it, nor
    make another file at ``path`` (``_create`` never replaces one), until it is gone. Refused,
    it lets go of its own lock and tries again, ``REMOVE_TRIES`` times in all: two holders
    leaving at once each refuse the other's first try (where a refused conversion keeps the
    shared lock: flock over NFS), and the one that tries again alone is granted."""
    try:
        for attempt in range(REMOVE_TRIES):
            if _lock(fd, fcntl.LOCK_EX):
                if _is_at(fd, path):
                    path.unlink(missing_ok=True)
                return
            fcntl.flock(fd, fcntl.LOCK_UN)  # no longer a holder: the other one may take it
            if attempt + 1 < REMOVE_TRIES:
                time.sleep(REMOVE_RETRY_S)
    finally:
        os.close(fd)


def _lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file ``path`` names now (not one removed since it was opened)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
