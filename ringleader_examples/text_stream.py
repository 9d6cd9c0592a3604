"""The GPT recipe's text as a Ray Data pipeline (``dataset.ray_data``): lines read by
``read_text``, byte-tokenized and packed into windows of ``block_size`` tokens by
``map_batches``, the blocks in a seeded order. Try it:

    ringleader run examples/gpt.yaml --set "dataset={ray_data: ringleader_examples.text_stream:make_dataset, column: tokens}" \
        --set "scaling.resources_per_worker={CPU: 0.5}"

(Ray Data runs the pipeline in tasks of a CPU each: the workers must leave one free.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringleader_examples.gpt import TOKENS

# Lines per tokenizing batch: windows are packed within a batch, so it is part of the order.
LINES_PER_BATCH = 512


def pack_windows(batch: dict[str, np.ndarray], block_size: int) -> dict[str, np.ndarray]:
    """A batch of lines (``text``) as the ``tokens`` windows their bytes (each line ended by a
    newline) fill, the remainder dropped."""
    data = np.frombuffer("".join(f"{line}\n" for line in batch["text"]).encode("utf-8"), dtype=np.uint8)
    windows = len(data) // block_size
    return {"tokens": data[: windows * block_size].astype(np.int64).reshape(windows, block_size)}


def make_dataset(path: str | None = None, block_size: int = 128, blocks_seed: int = 0) -> Any:
    """The windows of ``path`` (default: the recipe's shipped text) as a ``ray.data.Dataset``."""
    import ray.data

    lines = ray.data.read_text(path or str(TOKENS.with_suffix(".txt")))
    windows = lines.map_batches(pack_windows, fn_kwargs={"block_size": block_size}, batch_size=LINES_PER_BATCH, batch_format="numpy")
    return windows.randomize_block_order(seed=blocks_seed)
