"""A Ray Data stream read as a map-style dataset: row ``i`` of the epoch is row ``i`` of the
feeder's pass (``orchestrator/data/feeder.py``), taken by reference from the chunk holding it
(zero-copy when the chunk is on this node). Whoever reads row ``i``, whenever, reads the same
row: the samplers, stealing, backups and redone steps work on it as on any dataset."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import ray
import torch
from torch.utils.data import Dataset

from jobspec.stream import FedStream

# A chunk whose owner (the feeder) died with it is asked for again, once: Ray restarts the
# feeder, which makes the chunk again from the stream.
_ATTEMPTS = 2
# Chunks asked for in one call to the feeder: the one needed and those after it. A call costs
# the feeder's whole round trip (milliseconds while its pipeline runs beside it, measured), a
# reference held here nothing but the chunk's place in the store until it is dropped.
REFS_PER_CALL = 4
# Chunks kept here once fetched: a step's shards and the next step's read-ahead read the same
# chunk or two, and a chunk small enough to live in its owner's memory (under 100 KiB) is
# fetched from the feeder again on every get.
VALUES_KEPT = 2


class StreamRows(Dataset):
    """Rows of ``stream``. The references to the chunks asked for last are kept (at most
    ``2 * REFS_PER_CALL``), so the next steps' rows need no call to the feeder, and the
    ``VALUES_KEPT`` chunks fetched last."""

    def __init__(self, stream: FedStream) -> None:
        self.stream = stream
        self._chunks = -(-stream.samples // stream.chunk_rows)
        self._refs: dict[int, Any] = {}
        self._values: dict[int, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()  # a step's read-ahead and its own reads share them

    def __len__(self) -> int:
        return self.stream.samples

    def __getitem__(self, row: int) -> Any:
        return self.__getitems__([row])[0]

    def __getitems__(self, rows: list[int]) -> list[Any]:
        positions = np.asarray(rows, dtype=np.int64)
        chunk_of = positions // self.stream.chunk_rows
        wanted = sorted(set(chunk_of.tolist()))
        out: list[Any] = [None] * len(positions)
        for chunk, columns in zip(wanted, self._fetch(wanted)):
            where = np.flatnonzero(chunk_of == chunk)
            for at, sample in zip(where, self._samples(columns, positions[where] - chunk * self.stream.chunk_rows)):
                out[at] = sample
        return out

    def _fetch(self, chunks: list[int]) -> list[dict[str, np.ndarray]]:
        for attempt in range(_ATTEMPTS):
            try:
                return self._values_of(chunks)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
                with self._lock:
                    self._refs.clear()
                if attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _values_of(self, chunks: list[int]) -> list[dict[str, np.ndarray]]:
        with self._lock:
            found = {chunk: self._values[chunk] for chunk in chunks if chunk in self._values}
        missing = [chunk for chunk in chunks if chunk not in found]
        if missing:
            fetched = dict(zip(missing, ray.get(self._refs_of(missing), timeout=self.stream.timeout_s)))
            found.update(fetched)
            with self._lock:  # the other thread may have kept and dropped chunks meanwhile
                self._values.update(fetched)
                for old in [chunk for chunk in self._values if chunk not in found][: max(0, len(self._values) - VALUES_KEPT)]:
                    del self._values[old]
        return [found[chunk] for chunk in chunks]

    def _refs_of(self, chunks: list[int]) -> list[Any]:
        with self._lock:
            missing = [chunk for chunk in chunks if chunk not in self._refs]
            if missing:
                # Not past the pass's end: the next pass starts when its rows are needed.
                asked = sorted({c for chunk in missing for c in range(chunk, min(chunk + REFS_PER_CALL, self._chunks))})
                refs = ray.get(self.stream.feeder.chunks.remote(asked), timeout=self.stream.timeout_s)
                if len(self._refs) + len(asked) > 2 * REFS_PER_CALL:
                    self._refs = {c: self._refs[c] for c in chunks if c in self._refs}
                self._refs.update(zip(asked, refs))
            return [self._refs[chunk] for chunk in chunks]

    def _samples(self, columns: dict[str, np.ndarray], rows: np.ndarray) -> list[Any]:
        if self.stream.column is not None:
            if self.stream.column not in columns:
                raise KeyError(f"the stream's rows have no column {self.stream.column!r} (they have {sorted(columns)})")
            return _tensors(columns[self.stream.column][rows])
        named = {name: _tensors(values[rows]) for name, values in columns.items()}
        return [dict(zip(named, values)) for values in zip(*named.values())]


def _tensors(values: np.ndarray) -> list[Any]:
    """One tensor per row of ``values`` (copied out of the read-only shared chunk); text stays
    text (a string a row, for a collate that tokenizes)."""
    if values.dtype.kind in "US" or (values.dtype == object and len(values) and isinstance(values[0], (str, bytes))):
        return [value.item() if isinstance(value, np.generic) else value for value in values]
    if values.dtype == object:  # rows of unequal length
        return [torch.as_tensor(np.array(value)) for value in values]
    return list(torch.from_numpy(np.array(values)).unbind(0))
