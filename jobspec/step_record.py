"""A step's reports of every rank as one record of columns (docs/architecture.md, "Step
records"): what the leader of published plans hands the driver once per step, instead of N
``StepTelemetry`` objects that the driver would unpickle, walk and write one by one.

Every field of ``StepTelemetry`` but ``shards`` is a number (ints, bools and floats alike held
exactly as float64: the ints are counts and bytes, far below 2**53), so a step is one
``(ranks x fields)`` float64 table plus each rank's shard tuple. Tables pickle as one buffer, and
the driver's sums, maxima and policies read their columns as arrays.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jobspec.durable import read_jsonl
from jobspec.wire import StepTelemetry

#: The table's columns: ``StepTelemetry``'s fields in order, less ``shards``.
COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(StepTelemetry) if f.name != "shards")
_INDEX = {name: i for i, name in enumerate(COLUMNS)}
#: Each column's type in ``StepTelemetry`` (its annotation, a string under postponed evaluation).
_DTYPE = {f.name: {"int": np.int64, "bool": np.bool_}.get(str(f.type), np.float64) for f in fields(StepTelemetry) if f.name in _INDEX}


def rows_table(reports: Sequence[StepTelemetry]) -> np.ndarray:
    """``reports`` as a ``(len(reports) x len(COLUMNS))`` float64 table, in their order."""
    table = np.empty((len(reports), len(COLUMNS)), dtype=np.float64)
    for row, report in enumerate(reports):
        values = vars(report)
        table[row] = [values[name] for name in COLUMNS]
    return table


@dataclass(frozen=True, eq=False)
class StepRecord:
    """Step ``step`` as reported by ranks in rank order: ``table`` (one row per rank, ``COLUMNS``)
    and ``shards[i]``, the shards row i's rank contributed. The step's reduced figures (loss,
    samples, census, ...) are the same in every row. ``complete``-ness is the caller's to know:
    a record may hold the ranks that reported only."""

    step: int
    table: np.ndarray
    shards: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, step: int, reports: Sequence[StepTelemetry]) -> StepRecord:
        """The record of ``reports`` (one step's, any order; sorted by rank here)."""
        ordered = sorted(reports, key=lambda r: r.rank)
        return cls(step, rows_table(ordered), tuple(r.shards for r in ordered))

    def __len__(self) -> int:
        return len(self.shards)

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` of ``COLUMNS``, one value per row (a view: do not write)."""
        return self.table[:, _INDEX[name]]

    def first(self, name: str) -> Any:
        """Row 0's ``name``, typed as in ``StepTelemetry`` (the reduced figures agree in every row)."""
        return self.table[0, _INDEX[name]].astype(_DTYPE[name]).item()

    def typed_columns(self) -> dict[str, Any]:
        """Every column as a contiguous array typed as in ``StepTelemetry`` (int64, bool or
        float64), and ``shards``: what telemetry.jsonl's line of the step holds."""
        by_column = np.ascontiguousarray(self.table.T)
        out: dict[str, Any] = {name: by_column[i].astype(_DTYPE[name], copy=False) for i, name in enumerate(COLUMNS)}
        out["shards"] = self.shards
        return out

    def telemetry_line(self) -> dict[str, Any]:
        """telemetry.jsonl's line of this step: ``{"step": ..., "columns": {name: [one per
        rank]}}`` (serialise with orjson's OPT_SERIALIZE_NUMPY; ``read_telemetry`` reads it)."""
        return {"step": self.step, "columns": self.typed_columns()}

    def reports(self) -> list[StepTelemetry]:
        """The rows as ``StepTelemetry`` (for what reads one rank's report at a time)."""
        columns = {name: values.tolist() for name, values in self.typed_columns().items() if name != "shards"}
        return [
            StepTelemetry(shards=shards, **dict(zip(columns, values)))
            for shards, values in zip(self.shards, zip(*columns.values()))
        ]


def telemetry_rows(line: dict[str, Any]) -> list[dict[str, Any]]:
    """A telemetry.jsonl line as one dict per rank (``StepTelemetry``'s fields; non-finite floats
    as None). A line of a run written before step records (one rank's report) is one already."""
    columns = line.get("columns")
    if columns is None:
        return [line]
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[name] for name in names))]


def read_telemetry(path: Path) -> list[dict[str, Any]]:
    """A run's telemetry.jsonl as one dict per rank per step, in the order written; [] if absent."""
    return [row for line in read_jsonl(path) for row in telemetry_rows(line)]


def pack_batch(reports: Sequence[StepTelemetry]) -> bytes:
    """One rank's reports of a batch (one per step, in step order) as bytes for the gather."""
    return pickle.dumps((rows_table(reports), [r.shards for r in reports]), protocol=pickle.HIGHEST_PROTOCOL)


def batch_records(first: int, packed: Sequence[bytes]) -> list[StepRecord]:
    """The records of a batch from step ``first`` from every rank's ``pack_batch``, in rank
    order. Raises ValueError if the ranks did not all report the same steps."""
    tables, shards = zip(*(pickle.loads(blob) for blob in packed)) if packed else ((), ())
    steps = {len(table) for table in tables}
    if len(steps) > 1:
        raise ValueError(f"the ranks reported different numbers of steps: {sorted(steps)}")
    stacked = np.stack(tables) if tables else np.empty((0, 0, len(COLUMNS)))  # ranks x steps x columns
    step_column = _INDEX["step"]
    records = []
    for index in range(stacked.shape[1] if tables else 0):
        table = np.ascontiguousarray(stacked[:, index, :])
        if (table[:, step_column] != first + index).any():
            raise ValueError(f"a rank's report {index} of the batch from step {first} is not of step {first + index}")
        records.append(StepRecord(first + index, table, tuple(rank[index] for rank in shards)))
    return records
