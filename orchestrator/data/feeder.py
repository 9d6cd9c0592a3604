"""The feeder: a Ray actor that runs a job's Ray Data stream and holds its rows in Ray's object
store, cut into chunks the workers take by reference (docs/data.md, "Ray Data").

Every epoch is one pass of the same dataset in the same order (``preserve_order``; shuffles
without a seed are refused before it starts), so chunk ``c`` is the same rows whenever it is
made: a chunk dropped from the store, a feeder restarted by Ray, or a resumed run makes it again
and gets what the first one held. That is what keeps a stream's samples a pure function of
their position, and every mechanism that moves shards between workers exact.

Chunks are made in the stream's order as workers ask for them, and at most ``held_chunks`` are
held (the oldest go first): about ``ahead_steps`` steps. A chunk asked for behind the pass, or
far ahead of it (a resume, a redo after a failure), starts a new pass at it: whole blocks
before it are skipped by their row counts without being fetched, but the pipeline still
produces them (Ray Data cannot start a pass in the middle of its inputs).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import ray

#: A chunk: the chunk's rows of each column.
Chunk = dict[str, np.ndarray]
#: A pass's rows a block at a time, from a row on.
Pass = Generator[Chunk, None, None]
# Blocks a pass reads ahead of the chunks being made, on a thread of its own: Ray Data hands
# out a block only when asked (polling its executor meanwhile), so a pass read on demand sat
# idle between chunks (0.3x Ray Data's own prefetching iterator, measured).
PREFETCH_BLOCKS = 4


def unseeded_shuffles(dataset: Any) -> list[str]:
    """The operators of ``dataset``'s plan that shuffle without a seed (a different order each
    pass): ``random_shuffle()``, ``randomize_block_order()``, a read's ``shuffle="files"``."""
    found: list[str] = []
    stack = [dataset._logical_plan.dag]
    while stack:
        op = stack.pop()
        stack.extend(op.input_dependencies)
        seed_config = getattr(op, "seed_config", None) or getattr(op, "_seed_config", None)
        if seed_config is not None and getattr(seed_config, "seed", None) is None:
            found.append(type(op).__name__)
        shuffle_config = getattr(op, "shuffle_config_factory", None)
        config = shuffle_config() if callable(shuffle_config) else None
        if config is not None and getattr(config, "seed", None) is None:
            found.append(type(op).__name__)
    return found


def _block_rows(bundle: Any) -> Iterator[tuple[Any, int, int]]:
    """(block ref, first row, end row) of each block a bundle delivers (a slice, or all of it)."""
    slices = bundle.slices or (None,) * len(bundle.block_refs)
    for ref, metadata, part in zip(bundle.block_refs, bundle.metadata, slices):
        if part is None:
            yield ref, 0, metadata.num_rows
        else:
            yield ref, part.start_offset, part.end_offset


class ChunkCutter:
    """Cuts passes of a stream into chunks of ``chunk_rows`` rows and holds at most
    ``held_chunks`` of them, the oldest made dropped first. ``start_pass(first_row)`` yields a
    new pass's rows from ``first_row`` on, a block (a column dict) at a time; ``store(chunk)``
    keeps a chunk and returns what ``chunks`` hands out for it (an object ref, in the actor)."""

    def __init__(
        self, chunk_rows: int, held_chunks: int, start_pass: Callable[[int], Pass], store: Callable[[Chunk], Any],
    ) -> None:
        self.chunk_rows = chunk_rows
        self.held_chunks = held_chunks
        self._start = start_pass
        self._store = store
        self.held: OrderedDict[int, tuple[Any, int]] = OrderedDict()  # chunk -> (stored, bytes)
        self._blocks: Pass | None = None
        self._left: Chunk | None = None  # rows the pass has read and no chunk holds yet
        self._next = 0  # the chunk the pass makes next
        self.counts = {"passes": 0, "chunks_made": 0, "blocks_skipped": 0, "rows_skipped": 0, "max_held_bytes": 0}

    def chunks(self, wanted: list[int]) -> list[Any]:
        """What ``store`` returned for each of the ``wanted`` chunks, made where not held.
        Raises ValueError for a chunk past the end of a pass."""
        keep = set(wanted)
        for chunk in sorted(keep - set(self.held)):
            self._make_through(chunk, keep)
        stored = [self.held[chunk][0] for chunk in wanted]
        self._drop_oldest(keep)
        return stored

    def stats(self) -> dict[str, int]:
        """What was done and held: passes started, chunks made, blocks skipped without a
        fetch, the most bytes of chunks held at once, and the bound in chunks."""
        return {**self.counts, "held_chunks_bound": self.held_chunks, "chunk_rows": self.chunk_rows}

    def _make_through(self, chunk: int, keep: set[int]) -> None:
        # Behind the pass, or further ahead than is held: a new pass that starts at the chunk.
        if self._blocks is None or not self._next <= chunk <= self._next + self.held_chunks:
            if self._blocks is not None:
                self._blocks.close()  # the old pass stops reading
            self._blocks = self._start(chunk * self.chunk_rows)
            self._left = None
            self._next = chunk
            self.counts["passes"] += 1
        while self._next <= chunk:
            rows = self._read(self.chunk_rows)
            self._drop_oldest(keep, room=1)
            self.held[self._next] = (self._store(rows), sum(column.nbytes for column in rows.values()))
            self.counts["chunks_made"] += 1
            self.counts["max_held_bytes"] = max(self.counts["max_held_bytes"], sum(b for _, b in self.held.values()))
            self._next += 1

    def _drop_oldest(self, keep: set[int], room: int = 0) -> None:
        """Drop the oldest chunks not in ``keep`` until ``room`` more fit under the bound."""
        for chunk in list(self.held):
            if len(self.held) + room <= self.held_chunks:
                return
            if chunk not in keep:
                del self.held[chunk]

    def _read(self, count: int) -> Chunk:
        """The pass's next ``count`` rows (fewer at its end); ValueError past the end."""
        assert self._blocks is not None
        parts: list[Chunk] = []
        have = 0
        while have < count:
            block = self._left if self._left is not None else next(self._blocks, None)
            self._left = None
            if block is None:
                break
            rows = len(next(iter(block.values())))
            take = min(rows, count - have)
            parts.append({name: values[:take] for name, values in block.items()})
            if take < rows:
                self._left = {name: values[take:] for name, values in block.items()}
            have += take
        if not parts:
            raise ValueError(f"chunk {self._next} is past the end of the stream ({self._next * self.chunk_rows} rows asked)")
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


class StreamFeeder(ChunkCutter):
    """The actor: ``dataset``'s (a ``ray.data.Dataset``) passes cut into chunks held in the
    object store (owned by this actor). Not thread-safe and needs not be: a Ray actor runs one
    call at a time, so passes advance in one order. ``timeout_s`` bounds each block's fetch."""

    def __init__(self, dataset: Any, chunk_rows: int, held_chunks: int, timeout_s: float) -> None:
        dataset.context.execution_options.preserve_order = True
        self.dataset = dataset
        self.timeout_s = timeout_s
        super().__init__(chunk_rows, held_chunks, self._pass_from, ray.put)

    def samples(self) -> int:
        """Rows in one pass (this runs the whole pipeline once)."""
        return self.dataset.count()

    def _pass_from(self, first_row: int) -> Pass:
        """A pass's rows from ``first_row`` on (``_blocks_from``), read ahead."""
        return read_ahead(self._blocks_from(first_row), PREFETCH_BLOCKS, self.timeout_s)

    def _blocks_from(self, first_row: int) -> Iterator[Chunk]:
        """A pass's rows from ``first_row`` on, a block at a time; blocks wholly before it are
        skipped by their row counts, never fetched."""
        from ray.data.block import BlockAccessor

        row = 0
        for bundle in self.dataset.iter_internal_ref_bundles():
            for ref, start, end in _block_rows(bundle):
                if end is not None and row + (end - start) <= first_row:
                    row += end - start
                    self.counts["blocks_skipped"] += 1
                    self.counts["rows_skipped"] += end - start
                    continue
                block = BlockAccessor.for_block(ray.get(ref, timeout=self.timeout_s))
                end = block.num_rows() if end is None else end
                columns = BlockAccessor.for_block(block.slice(start, end, copy=False)).to_numpy()
                rows = len(next(iter(columns.values())))
                skip = max(0, first_row - row)
                row += rows
                if skip < rows:
                    yield {name: values[skip:] for name, values in columns.items()}


_END = object()


def read_ahead(blocks: Iterator[Chunk], depth: int, timeout_s: float) -> Pass:
    """``blocks`` read by a thread of their own, at most ``depth`` ahead of the consumer. An
    error reading them is raised to the consumer; closing the generator stops the thread at
    its next block; a block not come within ``timeout_s`` is a TimeoutError."""
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
                if not offer(block):
                    return
            offer(_END)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, who raises it
            offer(err)

    threading.Thread(target=fill, name="feeder-read-ahead", daemon=True).start()
    try:
        while True:
            try:
                item = ready.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no block of the stream came within {timeout_s:.0f}s") from None
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
