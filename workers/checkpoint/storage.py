"""Checkpoint files on a local directory or a cloud URI: names, atomic writes, reads,
listing, deletion. Manifests (what makes a checkpoint exist) are ``workers/checkpoint/manifest.py``.

Layout: ``<root>/step-00000040/`` holds one checkpoint (40 = completed steps); the driver
makes ``root`` a run's own namespace under the job's ``checkpoint.path`` (``sub_root``,
``orchestrator/checkpoints/namespace.py``).

No torch or Ray here; pyarrow is imported only when the root is a URI.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Callable

from jobspec.durable import write_atomic
from jobspec.redaction import redact
from workers.checkpoint.file_io import HashingWriter, RangedReader, makedirs_durable, write_direct

if TYPE_CHECKING:
    import pyarrow.fs  # noqa: F401 - annotations only: imported where a URI needs it

_CHUNK = 1 << 20
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_NAME = re.compile(r"step-(\d+)")


def absolute_root(root: str) -> str:
    """``root`` with a local path made absolute (in this process's working directory); URIs as
    they are. The driver resolves the root once, so every worker writes where the manifest is
    (a worker's working directory need not be the driver's)."""
    return root if _URI.match(root) else os.path.abspath(root)


def sub_root(root: str, name: str) -> str:
    """The root of the directory ``name`` (one path part) under ``root``, a path or URI. In a URI
    it goes at the end of the path, before any query string (pyarrow takes options there:
    ``s3://bucket/ckpt?region=...``)."""
    split_relpath(name)
    if "/" in name:
        raise ValueError(f"name must be one path part, got {name!r}")
    if not _URI.match(root):
        return os.path.join(root, name)
    # By hand: urlunsplit would drop an empty authority ("mock:///ckpt" -> "mock:/ckpt").
    base, query, options = root.partition("?")
    return f"{base if base.endswith('/') else base + '/'}{name}{query}{options}"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` (>= 0) completed steps."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    # Zero-padded so names sort like steps in listings and consoles.
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a name made by :func:`checkpoint_name`; None for any other name."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    # Only the canonical spelling: "step-40" is not the directory checkpoint 40 is written to.
    return step if checkpoint_name(step) == name else None


class CheckpointStorage:
    """Root of a job's checkpoints.

    ``root`` is a local directory (a plain path, or a ``file://`` URI, handled as local) or a
    URI with a scheme ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``, ``gs://``,
    ``hdfs://``, ...). Paths given to the methods are ``/``-separated and relative to the root.

    Writes are all-or-nothing: a reader sees a file's old content or its new content, never
    part of it. Locally that is a temp file renamed over the target; on object stores an object
    is published whole when its upload is closed.
    """

    def __init__(self, root: str) -> None:
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a non-empty path or URI, got {root!r}")
        self.root = root
        self._local: str | None = None
        self._fs: pyarrow.fs.FileSystem | None = None
        self._base = ""
        if not _URI.match(root):
            self._local = os.path.abspath(root)
        elif root.lower().startswith("file://"):
            parsed = urllib.parse.urlparse(root)
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"root {root!r}: a file:// URI must name a local path, not host {parsed.netloc!r}")
            self._local = os.path.abspath(urllib.parse.unquote(parsed.path))
        else:
            import pyarrow.fs

            self._fs, base = pyarrow.fs.FileSystem.from_uri(root)
            self._base = base.rstrip("/")

    @property
    def is_local(self) -> bool:
        """Whether the root is a local directory (plain path or ``file://``)."""
        return self._local is not None

    @property
    def where(self) -> str:
        """The root's full local path or URI, for messages (credentials masked)."""
        return self._local if self._local is not None else redact(self.root)

    def location(self, relpath: str) -> str:
        """The full local path or URI of ``relpath``, for messages (credentials masked)."""
        parts = split_relpath(relpath)
        if self._local is not None:
            return os.path.join(self._local, *parts)
        return redact(self.root.rstrip("/") + "/" + "/".join(parts))

    def write_bytes(self, relpath: str, data: bytes) -> str:
        """Write ``data`` to ``relpath`` atomically, creating parent directories; returns its sha256 hex."""
        sha, _ = self.write_file_from(relpath, lambda handle: handle.write(data))
        return sha

    def write_aligned(self, relpath: str, data: memoryview) -> tuple[str, int]:
        """Write ``data`` (a buffer whose address and length are multiples of the page size, as
        ``workers/checkpoint/tensor_file.py`` makes them) to ``relpath`` atomically, as ``write_file_from``
        does; returns ``(sha256 hex, size in bytes)``. A local file is written with direct I/O
        where its file system takes it (``write_direct``): no copy through the page cache, whose
        CPU a write otherwise takes from training."""
        if self._local is None:
            return self._upload_from(relpath, lambda handle: handle.write(data))
        target = self._path(relpath)
        makedirs_durable(os.path.dirname(target))
        # Hashed here, not on the way: the file gets exactly these bytes or the write raises.
        sha256 = hashlib.sha256(data).hexdigest()
        write_atomic(Path(target), lambda handle: write_direct(handle.fileno(), data))
        return sha256, len(memoryview(data))

    def write_file_from(self, relpath: str, write: Callable[[BinaryIO], None]) -> tuple[str, int]:
        """Write ``relpath`` atomically with the bytes ``write(handle)`` writes (e.g.
        ``torch.save(obj, handle)``); returns ``(sha256 hex, size in bytes)`` of those bytes.

        The handle only writes forward (no seek). If ``write`` raises, the target keeps its old
        content (or stays absent), no temp file is left, and the exception propagates.

        Remote roots spool the bytes to a local temp file first and upload it only once
        ``write`` has returned: an upload stream publishes whatever it has when closed and
        pyarrow cannot abort one, so streaming directly would publish partial files on error.
        For the same reason an error in the upload itself may leave a partial object; the
        manifest's sizes and sha256s are what catch that.
        """
        if self._local is None:
            return self._upload_from(relpath, write)
        target = self._path(relpath)
        makedirs_durable(os.path.dirname(target))
        hashed: HashingWriter | None = None

        def write_hashed(raw: IO[bytes]) -> None:
            nonlocal hashed
            hashed = HashingWriter(raw)
            write(hashed)

        # Private (0600), fsynced, renamed over the target, the directory fsynced; no temp file
        # is left behind, whatever ``write`` raises (a KeyboardInterrupt mid-save included).
        write_atomic(Path(target), write_hashed)
        assert hashed is not None
        return hashed.hexdigest(), hashed.size

    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of ``relpath``; FileNotFoundError if it does not exist."""
        if self._local is not None:
            with open(self._path(relpath), "rb") as f:
                return f.read()
        assert self._fs is not None
        with self._fs.open_input_stream(self._path(relpath)) as f:
            return f.read()

    @contextmanager
    def open_ranged(self, relpath: str) -> Iterator[RangedReader]:
        """``relpath`` open for reads at any offset, for the ``with`` block: a local file, or a
        pyarrow random-access file (ranged GETs on an object store), so a reader takes only the
        bytes it wants. FileNotFoundError if it does not exist."""
        if self._local is not None:
            with open(self._path(relpath), "rb", buffering=0) as local:
                yield RangedReader(local, os.fstat(local.fileno()).st_size, self.location(relpath))
            return
        assert self._fs is not None
        with self._fs.open_input_file(self._path(relpath)) as remote:
            yield RangedReader(remote, remote.size(), self.location(relpath))

    def sha256_of(self, relpath: str) -> tuple[str, int]:
        """``(sha256 hex, size in bytes)`` of ``relpath``, read in chunks (checkpoints can be large)."""
        digest, size = hashlib.sha256(), 0
        opened: Any
        if self._local is not None:
            opened = open(self._path(relpath), "rb")
        else:
            assert self._fs is not None
            opened = self._fs.open_input_stream(self._path(relpath))
        with opened as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def size(self, relpath: str) -> int | None:
        """Size of the file ``relpath`` in bytes; None if there is no such file."""
        if self._local is not None:
            path = self._path(relpath)
            return os.path.getsize(path) if os.path.isfile(path) else None
        import pyarrow.fs

        assert self._fs is not None
        info = self._fs.get_file_info(self._path(relpath))
        return info.size if info.type == pyarrow.fs.FileType.File else None

    def modified(self, relpath: str) -> float | None:
        """When the file ``relpath`` was last written (POSIX seconds), by the storage's clock (a
        file server's or object store's, not this host's); None if there is no such file or the
        storage keeps no such time."""
        if self._local is not None:
            try:
                return os.stat(self._path(relpath)).st_mtime
            except FileNotFoundError:
                return None
        import pyarrow.fs

        assert self._fs is not None
        info = self._fs.get_file_info(self._path(relpath))
        return info.mtime_ns / 1e9 if info.type == pyarrow.fs.FileType.File and info.mtime_ns is not None else None

    def exists(self, relpath: str) -> bool:
        """Whether ``relpath`` exists (file or directory)."""
        if self._local is not None:
            return os.path.exists(self._path(relpath))
        import pyarrow.fs

        assert self._fs is not None
        return self._fs.get_file_info(self._path(relpath)).type != pyarrow.fs.FileType.NotFound

    def list_dirs(self) -> list[str]:
        """Sorted names of the root's immediate subdirectories; empty if the root does not exist."""
        if self._local is not None:
            try:
                with os.scandir(self._local) as entries:
                    return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                return []
        import pyarrow.fs

        assert self._fs is not None
        selector = pyarrow.fs.FileSelector(self._base, recursive=False, allow_not_found=True)
        infos = self._fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory)

    def delete_file(self, relpath: str) -> None:
        """Delete the file ``relpath``; a missing one is fine."""
        try:
            if self._local is not None:
                os.remove(self._path(relpath))
            else:
                assert self._fs is not None
                self._fs.delete_file(self._path(relpath))
        except FileNotFoundError:
            pass

    def delete_tree(self, relpath: str) -> None:
        """Delete the directory ``relpath`` and everything under it; a missing one is fine."""
        if self._local is not None:
            try:
                shutil.rmtree(self._path(relpath))
            except FileNotFoundError:
                pass
            return
        assert self._fs is not None
        try:
            self._fs.delete_dir(self._path(relpath))
        except FileNotFoundError:
            pass

    def _path(self, relpath: str) -> str:
        parts = split_relpath(relpath)
        if self._local is not None:
            return os.path.join(self._local, *parts)
        return "/".join([self._base, *parts]) if self._base else "/".join(parts)

    def _upload_from(self, relpath: str, write: Callable[[BinaryIO], None]) -> tuple[str, int]:
        assert self._fs is not None
        target = self._path(relpath)
        with tempfile.TemporaryFile() as spool:
            hashed = HashingWriter(spool)
            write(hashed)
            spool.flush()
            spool.seek(0)
            parent = target.rsplit("/", 1)[0] if "/" in target else ""
            if parent:
                # Object stores need no directories, but hierarchical ones (HDFS, local) do.
                self._fs.create_dir(parent, recursive=True)
            with self._fs.open_output_stream(target) as out:
                while chunk := spool.read(_CHUNK):
                    out.write(chunk)
        return hashed.hexdigest(), hashed.size


def split_relpath(relpath: str) -> list[str]:
    """The parts of a checkpoint-relative path; ValueError for one that could escape the root."""
    # Refuse anything that could escape the root: checkpoint paths come from manifests on disk.
    parts = relpath.split("/") if isinstance(relpath, str) else []
    if not parts or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in relpath:
        raise ValueError(f"path must be relative, '/'-separated, without '.' or '..' parts, got {relpath!r}")
    return parts
