"""Passes over a stream, a block of rows at a time from any row on: what the feeder
(``orchestrator/data/feeder.py``) cuts into chunks. One interface, ``StreamPasses``, two
sources: a Ray Data ``Dataset`` (its blocks, those wholly before the row skipped by their row
counts, never fetched) and a Hugging Face streaming ``IterableDataset`` (its batches, those
before the row read and dropped). Both read ahead on a thread of their own (``read_ahead``)."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any, Protocol

import numpy as np
import ray

#: A block or a chunk: its rows of each column.
Chunk = dict[str, np.ndarray]
#: A pass's rows a block at a time, from a row on.
Pass = Generator[Chunk, None, None]
# Blocks a pass reads ahead of the chunks being made, on a thread of its own: Ray Data hands
# out a block only when asked (polling its executor meanwhile), so a pass read on demand sat
# idle between chunks (0.3x Ray Data's own prefetching iterator, measured).
PREFETCH_BLOCKS = 4
# Rows a Hugging Face stream hands over at a time.
ITERABLE_BATCH_ROWS = 1024


class StreamPasses(Protocol):
    def rows(self) -> int:
        """Rows in one pass (a whole pass runs to count them)."""
        ...

    def blocks_from(self, first_row: int) -> Iterator[Chunk | None]:
        """A new pass's rows from ``first_row`` on, a block at a time, and None for each block
        skipped on the way (progress, so a long skip is not silence); ``counts`` (the
        feeder's) says what was skipped."""
        ...


def passes_of(dataset: Any, timeout_s: float, counts: dict[str, int]) -> StreamPasses:
    """The passes of a ``ray.data.Dataset`` (run with ``preserve_order``) or of a Hugging Face
    ``IterableDataset``; TypeError for anything else."""
    if isinstance(dataset, ray.data.Dataset):
        return RayDataPasses(dataset, timeout_s, counts)
    if is_hf_stream(dataset):
        return IterablePasses(dataset, counts)
    raise TypeError(f"expected a ray.data.Dataset or a Hugging Face datasets.IterableDataset, got {type(dataset).__name__}")


def is_hf_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``IterableDataset`` (``datasets`` imported only if
    the caller already has: such a dataset came from it)."""
    hf = sys.modules.get("datasets")
    return hf is not None and isinstance(dataset, hf.IterableDataset)


class RayDataPasses:
    def __init__(self, dataset: Any, timeout_s: float, counts: dict[str, int]) -> None:
        dataset.context.execution_options.preserve_order = True
        self.dataset = dataset
        self.timeout_s = timeout_s
        self.counts = counts

    def rows(self) -> int:
        return int(self.dataset.count())

    def blocks_from(self, first_row: int) -> Iterator[Chunk | None]:
        def blocks() -> Iterator[tuple[int | None, Callable[[], Chunk]]]:
            for bundle in self.dataset.iter_internal_ref_bundles():
                for ref, start, end in _block_rows(bundle):
                    yield (None if end is None else end - start), partial(self._read_block, ref, start, end)

        return _from_row(blocks(), first_row, self.counts)

    def _read_block(self, ref: Any, start: int, end: int | None) -> Chunk:
        from ray.data.block import BlockAccessor

        block = BlockAccessor.for_block(ray.get(ref, timeout=self.timeout_s))
        end = block.num_rows() if end is None else end
        return BlockAccessor.for_block(block.slice(start, end, copy=False)).to_numpy()


def _block_rows(bundle: Any) -> Iterator[tuple[Any, int, int]]:
    """(block ref, first row, end row) of each block a bundle delivers (a slice, or all of it)."""
    slices = bundle.slices or (None,) * len(bundle.block_refs)
    for ref, metadata, part in zip(bundle.block_refs, bundle.metadata, slices):
        if part is None:
            yield ref, 0, metadata.num_rows
        else:
            yield ref, part.start_offset, part.end_offset


class IterablePasses:
    """A Hugging Face ``IterableDataset``: a pass is one iteration (its shuffle, if any, is the
    same every pass: its seed is in the object the feeder was given)."""

    def __init__(self, dataset: Any, counts: dict[str, int]) -> None:
        self.dataset = dataset
        self.counts = counts

    def rows(self) -> int:
        return sum(_rows(batch) for batch in self.dataset.iter(batch_size=ITERABLE_BATCH_ROWS))

    def blocks_from(self, first_row: int) -> Iterator[Chunk | None]:
        batches = self.dataset.iter(batch_size=ITERABLE_BATCH_ROWS)
        return _from_row(((_rows(batch), partial(_columns, batch)) for batch in batches), first_row, self.counts)


def _rows(batch: dict[str, Any]) -> int:
    return len(next(iter(batch.values())))


def _columns(batch: dict[str, Any]) -> Chunk:
    return {name: _column(values) for name, values in batch.items()}


def _from_row(
    blocks: Iterator[tuple[int | None, Callable[[], Chunk]]], first_row: int, counts: dict[str, int],
) -> Iterator[Chunk | None]:
    """A pass's rows from ``first_row`` on, out of its ``blocks`` (each its row count, when
    known, and how to read it): a block wholly before the row is skipped by its count, unread,
    and stands as None (progress); the block the row is in is cut there."""
    row = 0
    for known, read in blocks:
        if known is not None and row + known <= first_row:
            row += known
            counts["blocks_skipped"] += 1
            counts["rows_skipped"] += known
            yield None
            continue
        columns = read()
        rows = _rows(columns)
        skip = max(0, first_row - row)
        row += rows
        if skip < rows:
            yield {name: values[skip:] for name, values in columns.items()}


def _column(values: Any) -> np.ndarray:
    """A batch's column as an array: rows of equal length stacked, unequal ones kept apart."""
    try:
        return np.asarray(values)
    except ValueError:  # ragged
        column = np.empty(len(values), dtype=object)
        column[:] = [np.asarray(value) for value in values]
        return column


_END = object()
_PROGRESS = object()


def read_ahead(blocks: Iterator[Chunk | None], depth: int, timeout_s: float) -> Pass:
    """``blocks`` read by a thread of their own, at most ``depth`` ahead of the consumer (a
    None among them, a block skipped, is progress and not handed on). An error reading them
    is raised to the consumer; closing the generator stops the thread at its next block and
    closes ``blocks``; ``timeout_s`` without a block or progress is a TimeoutError."""
    ready: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def offer(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fill() -> None:
        try:
            for block in blocks:
                if not offer(_PROGRESS if block is None else block):
                    return
            offer(_END)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, who raises it
            offer(err)
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()  # a Ray Data pass's iterator ends (and its executor with it)

    threading.Thread(target=fill, name="feeder-read-ahead", daemon=True).start()
    try:
        while True:
            try:
                item = ready.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no block of the stream came within {timeout_s:.0f}s") from None
            if item is _END:
                return
            if item is _PROGRESS:
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
