"""The index of a job's data files: what the driver builds once (``orchestrator/data/index.py``)
and every worker reads samples by (``workers/data/files.py``). Plain data, JSON-able.

Sample ``i`` of the data is row ``i - first`` of the file whose samples start at ``first``: the
files' samples laid end to end, in the order the files were listed (a glob's matches sorted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class IndexedFile:
    """One file: ``uri`` (a path or a URI, as listed), ``bytes``, ``version`` (what tells that
    it changed: its modification time in ns), ``samples`` it holds, and ``layout``: what its
    format needs to find a sample (a data offset, row-group sizes, line offsets; JSON-able)."""

    uri: str
    bytes: int
    version: int
    samples: int
    layout: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DataIndex:
    """The files of one data source (``dataset`` or ``eval``), in order, with the ``format``
    and ``spec`` (the source's file fields: ``dtype``, ``seq_len``, ``column``) they were
    indexed under."""

    format: str
    spec: dict[str, Any]
    files: tuple[IndexedFile, ...]

    def __post_init__(self) -> None:
        counts = np.array([entry.samples for entry in self.files], dtype=np.int64)
        object.__setattr__(self, "_starts", np.cumsum(counts) - counts)  # where each file's samples start
        object.__setattr__(self, "_total", int(counts.sum()))

    @property
    def samples(self) -> int:
        return self._total  # type: ignore[attr-defined]

    def locate_all(self, samples: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(the number of the file holding each of ``samples``, its row there), int64 arrays.
        Raises IndexError if one is outside ``[0, samples)``."""
        wanted = np.asarray(samples, dtype=np.int64)
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= self.samples):
            raise IndexError(f"samples {list(samples)} of {self.samples}")
        files = np.searchsorted(self._starts, wanted, side="right") - 1  # type: ignore[attr-defined]
        return files, wanted - self._starts[files]  # type: ignore[attr-defined]

    def locate(self, sample: int) -> tuple[IndexedFile, int]:
        """The file holding ``sample`` and its row there (``locate_all`` of one)."""
        files, rows = self.locate_all([sample])
        return self.files[int(files[0])], int(rows[0])

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "spec": self.spec, "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DataIndex":
        return cls(data["format"], dict(data["spec"]), tuple(IndexedFile(**f) for f in data["files"]))


def changes(saved: IndexedFile, now: IndexedFile) -> list[str]:
    """What differs between a file as indexed (``saved``) and as found ``now``: its size or its
    version (modification time); [] if neither."""
    found = []
    if saved.bytes != now.bytes:
        found.append(f"size {saved.bytes} -> {now.bytes} bytes")
    if saved.version != now.version:
        found.append(f"modified (mtime {saved.version} -> {now.version} ns)")
    return found
