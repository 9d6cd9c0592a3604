"""One file's bytes, written and read: O_DIRECT writes of aligned buffers, a sha256 taken as the
bytes are written, directories made durably, ranged reads of an open file."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from typing import IO, Any

from jobspec.durable import fsync_dir


class RangedReader:
    """An open file of ``size`` bytes (``where``: its path or URI, for messages) read at any offset."""

    def __init__(self, handle: Any, size: int, where: str) -> None:
        self._handle = handle  # seek and readinto: a raw local file or a pyarrow NativeFile
        self.size = size
        self.where = where

    def read_into(self, offset: int, into: memoryview) -> None:
        """Fill ``into`` (a writable buffer: a tensor's memory, say) with the file's bytes from
        ``offset``, with no copy between. Raises EOFError if the file ends first."""
        view = memoryview(into).cast("B")
        self._handle.seek(offset)
        done = 0
        while done < len(view):  # a read may return less than asked: a raw file's, a network's
            got = self._handle.readinto(view[done:])
            if not got:
                raise EOFError(f"{self.where}: {len(view)} bytes wanted at {offset}, the file ends after {done}")
            done += got

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes from ``offset`` (EOFError if the file ends first)."""
        out = bytearray(nbytes)
        self.read_into(offset, memoryview(out))
        return bytes(out)


def write_direct(fd: int, data: memoryview) -> bool:
    """Write all of ``data`` to the file ``fd`` (freshly opened, nothing written to it yet) with
    ``O_DIRECT`` where the file system takes it (ext4, xfs: the disk reads the buffer, no CPU
    copy), else through the page cache (tmpfs and others refuse it: EINVAL). ``data``'s address
    and length must be multiples of the page size for the direct write. Returns whether it was
    direct."""
    view = memoryview(data).cast("B")
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    direct = hasattr(os, "O_DIRECT")
    if direct:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError:
            direct = False
    written = 0
    while written < len(view):
        try:
            written += os.write(fd, view[written:])
        except OSError as err:
            if not direct or err.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # direct I/O refused here: through the cache
            direct = False
    return direct


class HashingWriter:
    """Passes writes through to ``raw`` and hashes them on the way, so nothing is read back."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # Buffered files (all we wrap) write everything or raise, so the hash covers exactly the file.
        self._raw.write(view)
        self._sha.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        # Seeking back would make the running hash wrong; writers must stream.
        return False

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def makedirs_durable(directory: str) -> None:
    # A new directory's entry lives in its parent: fsync each parent we add to, or a crash could
    # lose a directory whose files (and manifest) were all fsynced.
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:  # a concurrent writer made it first
            pass
        fsync_dir(os.path.dirname(path))
