"""Streams for the tests: a few parquet files of numbered text rows, read by Ray Data and
tokenized by ``map_batches`` into rows whose ``tokens`` carry the row's id (``ledger.SEQ``
copies), the source ``tests/helpers/ledger.py`` counts; the same ids as Hugging Face datasets,
map-style and streaming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers.ledger import SAMPLES, SEQ


def write_numbered_text(directory: Path, files: int = 3) -> Path:
    """``files`` parquet files whose rows, in file order, are ids 0..SAMPLES-1 and their text."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, ids in enumerate(np.array_split(np.arange(SAMPLES), files)):
        pq.write_table(pa.table({"id": ids, "text": [f"sample {i}" for i in ids]}), directory / f"part-{number:02d}.parquet")
    return directory


def tokenize(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A toy tokenizer: the number in each text, ``SEQ`` times."""
    numbers = np.array([int(text.split()[-1]) for text in batch["text"]], dtype=np.int64)
    return {"tokens": np.repeat(numbers[:, None], SEQ, axis=1)}


def make_stream(directory: str, blocks_seed: int | None = None, unseeded: str = "") -> Any:
    """The tokenized rows of the parquet files in ``directory``; blocks in a seeded random order
    with ``blocks_seed``. To be refused, an order that changes from pass to pass: ``unseeded``
    ``rows`` (``random_shuffle()``), ``files`` (the read's ``shuffle="files"``, seeded from the
    clock) or ``reseeded`` (a file shuffle's seed, which Ray Data mixes with the pass's number
    by default)."""
    import ray.data

    # Ray Data reads small files into one block: 8 blocks of 5 rows, for block order and skips.
    shuffle = {"files": "files", "reseeded": ray.data.FileShuffleConfig(seed=3)}.get(unseeded)
    dataset = ray.data.read_parquet(directory, shuffle=shuffle).repartition(8).map_batches(tokenize, batch_format="numpy")
    if blocks_seed is not None:
        dataset = dataset.randomize_block_order(seed=blocks_seed)
    return dataset.random_shuffle() if unseeded == "rows" else dataset


def stream_ids(directory: str, **kwargs: Any) -> np.ndarray:
    """The ids of ``make_stream``'s rows in the order a pass yields them."""
    dataset = make_stream(directory, **kwargs)
    dataset.context.execution_options.preserve_order = True
    return np.array([row["tokens"][0] for row in dataset.take_all()])


def _id_rows() -> Any:
    for i in range(SAMPLES):
        yield {"tokens": [i] * SEQ}


def make_hf_map_dataset() -> Any:
    """A map-style Hugging Face dataset of the ids (as tensors): a dataset factory's, as it is."""
    import datasets

    return datasets.Dataset.from_dict({"tokens": [[i] * SEQ for i in range(SAMPLES)]}).with_format("torch")


def make_hf_stream(shuffle_seed: int | None = None) -> Any:
    """A streaming Hugging Face dataset of the ids (``datasets.IterableDataset``), fed as it is;
    shuffled by a buffer of 8 with ``shuffle_seed``."""
    import datasets

    stream = datasets.IterableDataset.from_generator(_id_rows)
    return stream if shuffle_seed is None else stream.shuffle(seed=shuffle_seed, buffer_size=8)


def hf_stream_ids(**kwargs: Any) -> np.ndarray:
    """The ids of ``make_hf_stream``'s rows in the order it yields them."""
    return np.array([row["tokens"][0] for row in make_hf_stream(**kwargs)])
