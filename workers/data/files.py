"""A job's data source as a map-style dataset: its factory's dataset, or its indexed files read
sample by sample straight from storage (``workers/data/formats.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import Dataset

from jobspec import targets as factories
from jobspec.data_index import DataIndex
from jobspec.recipe import DataSource
from jobspec.stream import DataFeed, FedStream
from workers.data.formats import FORMATS, as_samples
from workers.data.stream import StreamRows


def file_spec(source: DataSource) -> dict[str, Any]:
    """The fields of ``source`` its files are indexed and read under."""
    return {"dtype": source.dtype, "seq_len": source.seq_len, "column": source.column}


class IndexedFiles(Dataset):
    """The samples of ``index``'s files, laid end to end (``DataIndex.locate``); each read opens
    the file it needs, so two threads may read at once."""

    def __init__(self, index: DataIndex) -> None:
        self.index = index
        self.format = FORMATS[index.format]

    def __len__(self) -> int:
        return self.index.samples

    def __getitem__(self, sample: int) -> Any:
        entry, row = self.index.locate(int(sample))
        return self.format.read(entry, row, self.index.spec)

    def __getitems__(self, samples: list[int]) -> list[Any]:
        """``samples`` read together (torch's batched fetch): where every file they are in has
        a rows view (local token and .npy files), gathered from the views at numpy's speed;
        else one by one."""
        numbers, rows = (found.tolist() for found in self.index.locate_all(samples))
        views = {number: self.format.rows_view(self.index.files[number], self.index.spec) for number in set(numbers)}
        if all(view is not None for view in views.values()):
            return as_samples(np.stack([views[f][r] for f, r in zip(numbers, rows)]))  # type: ignore[index]
        return [self.format.read(self.index.files[f], r, self.index.spec) for f, r in zip(numbers, rows)]


def open_source(source: DataSource, fed: DataFeed | None) -> Dataset:
    """``source``'s dataset: its factory's, its files' as ``fed`` (their index, built by the
    driver for this source) lists them, or its Ray Data stream's rows as ``fed`` (its feeder)
    serves them. Raises ValueError if a file or stream source comes without what feeds it."""
    if source.factory is not None:
        return factories.build(source.factory, source.kwargs)
    if source.files is not None and isinstance(fed, DataIndex):
        return IndexedFiles(fed)
    if source.ray_data is not None and isinstance(fed, FedStream):
        return StreamRows(fed)
    if source.files is not None:
        raise ValueError(f"the files {source.files!r} come without their index (built by the driver)")
    raise ValueError(f"the stream {source.ray_data!r} comes without its feeder (started by the driver)")
