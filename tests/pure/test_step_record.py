"""Step records (``jobspec/step_record.py``): a step's reports of every rank as columns, packed by
each rank for the leader's gather and read by the driver without a ``StepTelemetry`` per rank."""

from __future__ import annotations

import pickle

import orjson
import pytest

from jobspec.step_record import COLUMNS, StepRecord, batch_records, pack_batch, telemetry_rows
from jobspec.wire import StepTelemetry


def _report(step: int, rank: int, **figures: object) -> StepTelemetry:
    values: dict[str, object] = dict(
        step=step, rank=rank, worker=10 + rank, shards=tuple(range(3 * rank, 3 * rank + 1 + rank % 2)), samples=4 + rank,
        global_samples=24, loss=0.25 + step, compute_s=0.01 * (rank + 1), comm_s=0.002, optim_s=0.001, step_s=0.05,
        shards_counted=6, lr=1e-3, weight=24.0, grad_norm=float("inf") if step == 1 else 1.5, skipped=step == 1,
        shards_run=2, shard_s=0.005, gave_up=rank == 2, bytes_sent=(1 << 40) + rank, stolen=rank, store_bytes=777,
    )
    values.update(figures)
    return StepTelemetry(**values)  # type: ignore[arg-type]


def test_a_record_reads_back_every_report_exactly_and_writes_the_same_telemetry_lines():
    reports = [_report(3, rank) for rank in (2, 0, 1)]  # any order in: rank order out
    record = StepRecord.of(3, reports)
    ordered = sorted(reports, key=lambda r: r.rank)
    assert record.reports() == ordered
    # telemetry.jsonl's line of the step reads back as the lines each StepTelemetry wrote
    # before (ints as ints, bools as bools, a byte count past 2**32, an infinite norm as null).
    line = orjson.loads(orjson.dumps(record.telemetry_line(), option=orjson.OPT_SERIALIZE_NUMPY))
    assert telemetry_rows(line) == [orjson.loads(orjson.dumps(r.to_json())) for r in ordered]
    assert telemetry_rows({"step": 3, "rank": 0}) == [{"step": 3, "rank": 0}]  # a line of an older run
    assert record.first("global_samples") == 24 and isinstance(record.first("global_samples"), int)
    assert record.first("skipped") is False and record.column("stolen").tolist() == [0, 1, 2]
    assert "shards" not in COLUMNS and len(record) == 3


def test_a_batch_packed_by_each_rank_becomes_one_record_per_step():
    by_rank = [[_report(step, rank) for step in (1, 2)] for rank in range(3)]
    packed = [pack_batch(reports) for reports in by_rank]
    records = batch_records(1, packed)
    assert [r.step for r in records] == [1, 2]
    for index, record in enumerate(records):
        assert record.reports() == [by_rank[rank][index] for rank in range(3)]
    # What crosses from the leader to the driver: a table and shard tuples, pickled as they are.
    assert pickle.loads(pickle.dumps(records))[1].reports() == records[1].reports()


def test_a_batch_whose_ranks_disagree_on_its_steps_is_refused():
    packed = [pack_batch([_report(1, 0), _report(2, 0)]), pack_batch([_report(1, 1)])]
    with pytest.raises(ValueError, match="different numbers of steps"):
        batch_records(1, packed)
    with pytest.raises(ValueError, match="is not of step 2"):
        batch_records(1, [pack_batch([_report(1, 0), _report(3, 0)])])


def test_an_empty_record_has_no_rows():
    record = StepRecord.of(5, [])
    assert len(record) == 0 and record.reports() == [] and telemetry_rows(record.telemetry_line()) == []
