"""A Ray Data stream as the workers see it (``orchestrator/data/feeder.py`` feeds it,
``workers/data/stream.py`` reads it): plain data and an actor handle, passed to every worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobspec.data_index import DataIndex


@dataclass(frozen=True)
class FedStream:
    """``feeder``: the actor holding the stream's chunks; ``samples``: rows in one epoch (every
    epoch is the same rows in the same order); chunk ``c`` holds rows
    ``[c * chunk_rows, (c + 1) * chunk_rows)`` of the epoch (the last one fewer); ``column``: the
    column a sample is (None: a dict of every column); ``timeout_s``: how long a read waits for
    the feeder before it fails (and the step with it)."""

    feeder: Any
    samples: int
    chunk_rows: int
    column: str | None
    timeout_s: float


#: What the driver hands the workers for a data source: its files' index or its stream's feeder.
DataFeed = DataIndex | FedStream
