"""A Ray Data stream read as a map-style dataset: row ``i`` of the epoch is row ``i`` of the
feeder's pass (``orchestrator/data/feeder.py``), taken by reference from the chunk holding it
(zero-copy when the chunk is on this node). Whoever reads row ``i``, whenever, reads the same
row: the samplers, stealing, backups and redone steps work on it as on any dataset."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch
from torch.utils.data import Dataset

from jobspec.stream import FedStream

# A chunk whose owner (the feeder) died with it is asked for again, once: Ray restarts the
# feeder, which makes the chunk again from the stream.
_ATTEMPTS = 2


class StreamRows(Dataset):
    def __init__(self, stream: FedStream) -> None:
        self.stream = stream

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
        timeout = self.stream.timeout_s
        for attempt in range(_ATTEMPTS):
            try:
                refs = ray.get(self.stream.feeder.chunks.remote(chunks), timeout=timeout)
                return ray.get(refs, timeout=timeout)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
                if attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _samples(self, columns: dict[str, np.ndarray], rows: np.ndarray) -> list[Any]:
        if self.stream.column is not None:
            if self.stream.column not in columns:
                raise KeyError(f"the stream's rows have no column {self.stream.column!r} (they have {sorted(columns)})")
            return _tensors(columns[self.stream.column][rows])
        named = {name: _tensors(values[rows]) for name, values in columns.items()}
        return [dict(zip(named, values)) for values in zip(*named.values())]


def _tensors(values: np.ndarray) -> list[torch.Tensor]:
    """One tensor per row of ``values`` (copied out of the read-only shared chunk)."""
    if values.dtype == object:  # rows of unequal length
        return [torch.as_tensor(np.array(value)) for value in values]
    return list(torch.from_numpy(np.array(values)).unbind(0))
