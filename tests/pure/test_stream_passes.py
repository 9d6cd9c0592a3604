"""Passes over a stream, pure: a Hugging Face style stream's batches from any row on (those
before it counted as skipped), ragged columns kept apart, and the read-ahead thread: in order,
its errors raised to the reader, stopped when the pass is dropped, a silent source timed out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from orchestrator.data.stream_passes import IterablePasses, read_ahead


class _Batches:
    """What ``IterablePasses`` uses of a Hugging Face ``IterableDataset``: ``iter(batch_size)``
    yielding dicts of lists; 10 rows, ``ragged`` of unequal lengths."""

    def iter(self, batch_size: int) -> Iterator[dict[str, list]]:
        for lo in range(0, 10, 4):
            rows = range(lo, min(lo + 4, 10))
            yield {"id": list(rows), "ragged": [list(range(r % 3)) for r in rows]}


def test_a_pass_from_a_row_skips_the_batches_before_it_and_slices_the_one_it_is_in():
    counts = {"blocks_skipped": 0, "rows_skipped": 0}
    passes = IterablePasses(_Batches(), counts)
    assert passes.rows() == 10
    skipped, *blocks = list(passes.blocks_from(5))
    assert skipped is None  # progress: the batch before row 5, read and dropped
    assert [b["id"].tolist() for b in blocks] == [[5, 6, 7], [8, 9]]
    assert counts == {"blocks_skipped": 1, "rows_skipped": 4}
    assert blocks[0]["ragged"].dtype == object and blocks[0]["ragged"][0].tolist() == [0, 1]


def test_read_ahead_keeps_order_raises_errors_and_stops_with_its_pass():
    assert [b["x"].tolist() for b in read_ahead(iter([{"x": np.arange(i)} for i in range(5)]), 2, 5.0)] == [
        [], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3]
    ]

    def failing() -> Iterator[dict]:
        yield {"x": np.zeros(1)}
        raise OSError("block 2 unreadable")

    reader = read_ahead(failing(), 2, 5.0)
    next(reader)
    with pytest.raises(OSError, match="block 2 unreadable"):
        next(reader)

    made = []

    def endless() -> Iterator[dict]:
        while True:
            made.append(1)
            yield {"x": np.zeros(1)}

    reader = read_ahead(endless(), 2, 5.0)
    next(reader)
    reader.close()
    time.sleep(0.3)
    stopped_at = len(made)
    time.sleep(0.3)
    assert len(made) == stopped_at <= 4  # the depth, the one handed out and the one waiting
    assert not [t for t in threading.enumerate() if t.name == "feeder-read-ahead" and t.is_alive()]


def test_a_source_that_sends_nothing_times_out():
    release = threading.Event()

    def silent() -> Iterator[dict]:
        release.wait(5)
        yield {"x": np.zeros(1)}

    with pytest.raises(TimeoutError, match="no block of the stream came within 0s"):
        next(read_ahead(silent(), 2, 0.2))
    release.set()


def test_a_long_skip_is_progress_not_silence():
    """Blocks skipped on the way to a resume's row come as None: each resets the timeout, none
    reaches the reader."""
    def skipping() -> Iterator[dict | None]:
        for _ in range(6):
            time.sleep(0.1)
            yield None
        yield {"x": np.arange(3)}

    assert [b["x"].tolist() for b in read_ahead(skipping(), 2, 0.3)] == [[0, 1, 2]]
