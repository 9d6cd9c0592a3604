"""The feeder: a Ray actor that runs a job's stream (a Ray Data pipeline or a Hugging Face
streaming dataset: ``stream_passes.py``) and holds its rows in Ray's object store, cut into
chunks the workers take by reference (docs/data.md, "Ray Data").

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

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from orchestrator.data.stream_passes import PREFETCH_BLOCKS, Chunk, Pass, passes_of, read_ahead


def unseeded_shuffles(dataset: Any) -> list[str]:
    """The operators of ``dataset``'s plan whose order differs from pass to pass:
    ``random_shuffle()``, ``randomize_block_order()`` or a read's file shuffle without a seed,
    or with one Ray Data mixes with the pass's number (``reseed_after_execution``), or drawn
    anew each time it is asked for (``shuffle="files"``: a timestamp)."""
    found: list[str] = []
    stack = [dataset._logical_plan.dag]
    while stack:
        op = stack.pop()
        stack.extend(op.input_dependencies)
        config = getattr(op, "seed_config", None) or getattr(op, "_seed_config", None)
        factory = getattr(op, "shuffle_config_factory", None)
        drawn = [factory(), factory()] if callable(factory) else []
        if drawn and drawn[0] is not None and getattr(drawn[0], "seed", None) != getattr(drawn[1], "seed", None):
            found.append(f"{type(op).__name__}: a new seed each pass")
            continue
        for each in ([config] if config is not None else []) + [d for d in drawn[:1] if d is not None]:
            if getattr(each, "seed", None) is None:
                found.append(type(op).__name__)
            elif getattr(each, "reseed_after_execution", False):
                found.append(f"{type(op).__name__}: reseeded each pass")
    return found


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
            self._end_pass()
            self._blocks = self._start(chunk * self.chunk_rows)
            self._next = chunk
            self.counts["passes"] += 1
        try:
            while self._next <= chunk:
                rows = self._read(self.chunk_rows)
                self._drop_oldest(keep, room=1)
                self.held[self._next] = (self._store(rows), sum(column.nbytes for column in rows.values()))
                self.counts["chunks_made"] += 1
                self.counts["max_held_bytes"] = max(self.counts["max_held_bytes"], sum(b for _, b in self.held.values()))
                self._next += 1
        except BaseException:
            # The pass may have lost rows on the way (read, not yet held): the next request
            # starts a new one where it needs, so row i stays row i.
            self._end_pass()
            raise

    def _end_pass(self) -> None:
        if self._blocks is not None:
            self._blocks.close()  # the pass stops reading
        self._blocks, self._left = None, None

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
    """The actor: ``dataset``'s passes (``stream_passes.passes_of``: a ``ray.data.Dataset`` or a
    Hugging Face ``IterableDataset``) cut into chunks held in the object store (owned by this
    actor). Not thread-safe and needs not be: a Ray actor runs one call at a time, so passes
    advance in one order. ``timeout_s`` bounds the wait for each block."""

    def __init__(self, dataset: Any, chunk_rows: int, held_chunks: int, timeout_s: float) -> None:
        super().__init__(chunk_rows, held_chunks, self._pass_from, ray.put)
        self.passes = passes_of(dataset, timeout_s, self.counts)
        self.timeout_s = timeout_s

    def samples(self) -> int:
        """Rows in one pass (a whole pass runs to count them)."""
        return self.passes.rows()

    def _pass_from(self, first_row: int) -> Pass:
        return read_ahead(self.passes.blocks_from(first_row), PREFETCH_BLOCKS, self.timeout_s)
