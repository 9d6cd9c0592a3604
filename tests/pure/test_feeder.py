"""The feeder's chunking, pure: passes of a numbered stream cut into chunks, at most the bound
held, a chunk behind the pass or far ahead of it made by a new pass that starts there, and
every chunk the same rows however it was made."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from orchestrator.data.feeder import ChunkCutter
from orchestrator.data.stream_passes import Chunk

ROWS = 23
BLOCKS = (5, 1, 7, 4, 6)  # uneven blocks: chunks straddle them


def _cutter(chunk_rows: int = 3, held: int = 4) -> tuple[ChunkCutter, list[int]]:
    """A cutter over rows 0..ROWS-1 in BLOCKS; also the first rows its passes started at."""
    starts: list[int] = []

    def start_pass(first_row: int) -> Iterator[Chunk]:
        starts.append(first_row)
        edges = np.cumsum((0, *BLOCKS))
        for lo, hi in zip(edges[:-1], edges[1:]):
            if hi > first_row:
                rows = np.arange(max(lo, first_row), hi)
                yield {"id": rows, "pair": np.stack([rows, -rows], axis=1)}

    return ChunkCutter(chunk_rows, held, start_pass, store=lambda chunk: chunk), starts


def _ids(chunk: Chunk) -> list[int]:
    return chunk["id"].tolist()


def test_chunks_are_their_rows_in_order_across_blocks_and_the_short_last_one():
    cutter, starts = _cutter()
    got = [_ids(c) for c in cutter.chunks(list(range(8)))]
    assert got == [list(range(3 * c, min(3 * c + 3, ROWS))) for c in range(8)]
    assert starts == [0]  # one pass made them all
    assert cutter.chunks([2])[0]["pair"].tolist() == [[6, -6], [7, -7], [8, -8]]


def test_at_most_the_bound_is_held_and_a_dropped_chunk_is_made_again_alike():
    cutter, starts = _cutter(held=2)
    for chunk in range(8):
        first = _ids(cutter.chunks([chunk])[0])
        assert len(cutter.held) <= 2
    assert starts == [0]
    assert _ids(cutter.chunks([1])[0]) == [3, 4, 5]  # behind the pass: a new one, from row 3
    assert starts == [0, 3]
    assert first == [21, 22]
    assert cutter.stats()["max_held_bytes"] == 2 * 3 * (8 + 16)  # two chunks of 3 rows of 3 int64s


def test_a_chunk_far_ahead_starts_a_pass_there_and_a_request_larger_than_the_bound_is_served():
    cutter, starts = _cutter(held=2)
    assert _ids(cutter.chunks([6])[0]) == [18, 19, 20]
    assert starts == [6 * 3]  # a resume: the rows before are not read
    assert [_ids(c) for c in cutter.chunks([0, 1, 2, 3])] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert len(cutter.held) == 4  # what one call asks for is held until it returns
    cutter.chunks([4])
    assert len(cutter.held) == 2


def test_a_chunk_past_the_end_is_an_error():
    cutter, _ = _cutter()
    with pytest.raises(ValueError, match="chunk 8 is past the end of the stream"):
        cutter.chunks([8])


def test_a_pass_that_fails_is_dropped_and_the_next_request_starts_a_new_one_at_its_row():
    """Rows a failed pass read and no chunk held would shift every row after them: the request
    after the failure starts a new pass where it needs, and gets the rows it should."""
    starts: list[int] = []
    failures = [True]

    def start_pass(first_row: int) -> Iterator[Chunk]:
        starts.append(first_row)
        yield {"id": np.arange(first_row, first_row + 2)}  # read, not yet a whole chunk
        if failures.pop() if failures else False:
            raise TimeoutError("no block of the stream came")
        yield {"id": np.arange(first_row + 2, ROWS)}

    cutter = ChunkCutter(3, 4, start_pass, store=lambda chunk: chunk)
    with pytest.raises(TimeoutError):
        cutter.chunks([0])
    assert _ids(cutter.chunks([0])[0]) == [0, 1, 2] and _ids(cutter.chunks([1])[0]) == [3, 4, 5]
    assert starts == [0, 0]
