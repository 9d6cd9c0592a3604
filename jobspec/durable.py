"""Durable files both sides of the actor boundary write and read: a write that is whole or absent
(temp file, fsync, rename, directory fsync), and JSON-lines records that tolerate a live writer."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable


@functools.cache
def process_umask() -> int:
    """The process's umask, read once. From ``/proc/self/status`` where there is one: the only
    other way to read it is to set it, which would race with threads creating files (the
    workers' checkpoint writers, Ray's own threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's JSON-lines file (``events.jsonl``, ``telemetry.jsonl``); none if
    it does not exist. A run still writing may have cut its last line short: that one is left
    out. Raises ValueError naming the file and line for any other line that is not JSON."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()  # read once: a live run appends
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON ({err.msg})") from None
    return records


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], *, shared: bool = False) -> None:
    """Write via a temp file in the same directory, fsync, then rename over ``path``.

    A reader sees the old file or the new one, never a partial one. The file is private to
    its owner (``mkstemp``'s 0600), unless ``shared``: then readable as a new file would be
    (0666 less the umask), for what is made to be handed around (a report, a token file).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    if shared:
        os.fchmod(fd, 0o666 & ~process_umask())
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path | str) -> None:
    """Make ``directory``'s entries durable: a file renamed or a directory made in it is there
    after a crash only once its parent is fsynced too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
