"""A stream's rows read as a map-style dataset (``workers/data/stream.py``), pure: rows found in
their chunks in any order, samples made of a column or of every column; the feeder's part is
played by a dict of chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobspec.stream import FedStream
from workers.data.stream import StreamRows

CHUNK = 4


class _Rows(StreamRows):
    """Rows 0..9: ``tokens`` [i, i + 1], ``text`` of unequal lengths; chunks of CHUNK."""

    def __init__(self, column: str | None) -> None:
        super().__init__(FedStream(feeder=None, samples=10, chunk_rows=CHUNK, column=column, timeout_s=1.0))
        self.asked: list[list[int]] = []

    def _fetch(self, chunks: list[int]) -> list[dict[str, np.ndarray]]:
        self.asked.append(chunks)
        out = []
        for chunk in chunks:
            rows = np.arange(chunk * CHUNK, min(chunk * CHUNK + CHUNK, 10))
            ragged = np.empty(len(rows), dtype=object)
            ragged[:] = [list(range(r % 3 + 1)) for r in rows]
            out.append({"tokens": np.stack([rows, rows + 1], axis=1), "ragged": ragged})
        return out


def test_rows_come_from_their_chunks_in_the_order_asked():
    rows = _Rows("tokens")
    got = rows.__getitems__([9, 0, 5, 4, 1])
    assert [t.tolist() for t in got] == [[9, 10], [0, 1], [5, 6], [4, 5], [1, 2]]
    assert rows.asked == [[0, 1, 2]]  # each chunk fetched once, together
    assert got[0].dtype == torch.int64 and len(rows) == 10 and rows[7].tolist() == [7, 8]


def test_without_a_column_a_sample_is_every_column_and_ragged_rows_stay_apart():
    sample = _Rows(None).__getitems__([5])[0]
    assert sample["tokens"].tolist() == [5, 6] and sample["ragged"].tolist() == [0, 1, 2]


def test_a_column_the_rows_lack_is_named():
    with pytest.raises(KeyError, match=r"no column 'text' \(they have \['ragged', 'tokens'\]\)"):
        _Rows("text").__getitems__([0])


def test_text_columns_stay_text():
    from workers.data.stream import _tensors

    assert _tensors(np.array(["a", "bc"])) == ["a", "bc"]
    ragged = np.empty(2, dtype=object)
    ragged[:] = ["x", "yz"]
    assert _tensors(ragged) == ["x", "yz"]
