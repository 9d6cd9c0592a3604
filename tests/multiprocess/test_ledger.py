"""The exactly-once guards themselves: the driver's ``CommitLedger`` checks (orchestrator/accounting/ledger.py)
and the workers' census (workers/step/census.py), each shown to fire on a missing, an overlapping and a
doubled shard. (A whole job that finishes proves none of them: they hold it to that.)"""

from __future__ import annotations

import pytest
import torch

from jobspec.failures import ShardCensusError
from jobspec.step_record import StepRecord
from jobspec.wire import StepTelemetry
from orchestrator.accounting.ledger import CommitLedger
from orchestrator.errors import JobFailed
from workers.step.census import BOOKKEEPING_SLOTS, write_census
from workers.step.records import PassResult
from workers.step.verdict import GradientMeasure, StepVerdict, read_verdict

SHARDS = 4


def _report(rank: int, shards: tuple[int, ...], *, counted: int = SHARDS, skipped: bool = False, step: int = 0) -> StepTelemetry:
    return StepTelemetry(
        step=step, rank=rank, worker=rank, shards=shards, samples=2 * len(shards), global_samples=2 * SHARDS,
        loss=0.5, compute_s=0.0, comm_s=0.0, optim_s=0.0, step_s=0.0, shards_counted=counted, skipped=skipped,
    )


def test_a_step_whose_ranks_cover_every_shard_once_is_committed():
    ledger = CommitLedger(SHARDS)
    ledger.commit(0, StepRecord.of(0, [_report(0, (0, 1)), _report(1, (2, 3))]), complete=True)
    ledger.commit(1, StepRecord.of(1, [_report(0, (0,), step=1)]), complete=False)  # rank 1's report was lost with it
    assert ledger.steps_done == 2 and ledger.shards_committed == 2 * SHARDS and ledger.samples == 2 * 2 * SHARDS
    ledger.resume_at(5)
    assert ledger.steps_done == 5 and ledger.shards_committed == 5 * SHARDS


@pytest.mark.parametrize(
    "reports, complete, error",
    [
        # A shard nobody committed: every census says 4, the union says 3.
        ([_report(0, (0, 1)), _report(1, (2,))], True, "committed shards [0, 1, 2] are not each shard exactly once"),
        # Two ranks committed shard 1 and nobody shard 3.
        ([_report(0, (0, 1)), _report(1, (1, 2))], True, "committed shards [0, 1, 1, 2] are not each shard exactly once"),
        # Shard 2 twice among the reports that came back (some are missing after a death).
        ([_report(0, (0, 2)), _report(2, (2,))], False, "shards [0, 2, 2] were committed more than once"),
        # A census that counted a shard twice (or lost one) fails whatever the reports' shards.
        ([_report(0, (0, 1), counted=5), _report(1, (2, 3), counted=5)], True, "the census counted [5] shards, expected 4"),
        ([_report(0, (0, 1), counted=3), _report(1, (2, 3), counted=3)], True, "the census counted [3] shards, expected 4"),
        # Replicas that disagree on skipping the step (fp16) hold different parameters now.
        ([_report(0, (0, 1)), _report(1, (2, 3), skipped=True)], True, "replicas disagree on skipping the step"),
    ],
    ids=["missing", "overlapping", "doubled-among-survivors", "census-over", "census-under", "skip-disagreement"],
)
def test_a_step_that_is_not_each_shard_exactly_once_fails_and_is_not_committed(reports, complete, error):
    ledger = CommitLedger(SHARDS)
    with pytest.raises(JobFailed, match=error.replace("[", r"\[").replace("]", r"\]")):
        ledger.commit(0, StepRecord.of(0, reports), complete=complete)
    assert ledger.steps_done == 0 and ledger.shards_committed == 0 and ledger.samples == 0 and ledger.final_loss is None


def test_a_step_out_of_order_fails():
    ledger = CommitLedger(SHARDS)
    with pytest.raises(JobFailed, match="step 1 committed out of order"):
        ledger.commit(1, StepRecord.of(1, [_report(0, (0, 1, 2, 3), step=1)]), complete=True)


def _census(counts: list[float]) -> torch.Tensor:
    return torch.tensor([*counts, 6.0, 8.0, 8.0])  # then the loss sum, samples and weight


def _verdict(extra: torch.Tensor) -> StepVerdict:
    """The reduced ``extra`` slots as the host reads them (a gradient of norm 0)."""
    measure = GradientMeasure(torch.zeros(1), torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64))
    return read_verdict(extra, SHARDS, measure, clip=None, local_weight=0.0)


def test_the_census_written_by_each_rank_sums_to_one_per_shard():
    ranks = [torch.zeros(SHARDS + BOOKKEEPING_SLOTS) for _ in range(2)]
    write_census(ranks[0], SHARDS, [0, 3], PassResult(loss=1.5, weight=4.0, samples=4))
    write_census(ranks[1], SHARDS, [1, 2], PassResult(loss=2.5, weight=4.0, samples=4))
    census = _verdict(ranks[0] + ranks[1]).census(step=7)
    assert (census.shards_counted, census.loss_sum, census.samples, census.weight) == (SHARDS, 4.0, 8, 8.0)


@pytest.mark.parametrize(
    "counts, bad",
    [([1, 1, 0, 1], "{2: 0.0}"), ([1, 2, 0, 1], "{1: 2.0, 2: 0.0}"), ([1, 1, 2, 1], "{2: 2.0}")],
    ids=["missing", "overlapping", "doubled"],
)
def test_the_census_refuses_a_shard_not_counted_exactly_once(counts, bad):
    with pytest.raises(ShardCensusError, match=f"step 3: shards not committed exactly once: {bad}"):
        _verdict(_census(counts)).census(step=3)


def test_the_rescue_pass_runs_only_for_shards_nobody_brought():
    assert _verdict(_census([1, 0, 0, 1])).missing_shards() == [1, 2]
    assert _verdict(_census([1, 1, 1, 1])).missing_shards() == []  # every shard is there: no rescue
    # A shard counted twice is not the rescue's to mend (it would only add more): the census check fails it.
    assert _verdict(_census([2, 0, 1, 1])).missing_shards() == []
    assert _verdict(_census([1, 0.5, 1, 1])).missing_shards() == []


def _two_ranks_commit_one_shard(rank: int, world: int, port: int, results: dict) -> None:
    """Two real workers (``TrainWorker``, no Ray) in one gloo group; step 0 first under a plan that
    gives shard 1 to both ranks (and shard 3 to nobody), then under a right one."""
    from jobspec.wire import JoinRequest
    from orchestrator.job.reading import load_job
    from policies.work_stealing import StepPlan
    from tests.helpers.ranks import tcp_store
    from workers.actor import TrainWorker

    store = tcp_store(rank, world, port)  # rank 0 hosts it, as the driver does
    job = load_job(None, ["steps=2", "eval=null", f"shards={SHARDS}", "batch_size=16", "scaling.workers=2"])
    worker = TrainWorker(job, worker_id=rank)
    worker.join_group(JoinRequest("127.0.0.1", port, "gen1/", 1, rank, ("node", "node"), 30.0))
    before = worker.flat.values.clone()
    try:
        worker.train_step(0, StepPlan(((0, 1), (1, 2)), steal=False, speculate=False))
        results[rank, "bad"] = "applied"
    except ShardCensusError as err:
        results[rank, "bad"] = str(err)
    results[rank, "unchanged"] = torch.equal(worker.flat.values, before) and worker.next_step == 0
    report = worker.train_step(0, StepPlan(((0, 1), (2, 3)), steal=False, speculate=False))
    results[rank, "good"] = (report.shards_counted, worker.next_step, not torch.equal(worker.flat.values, before))
    worker.leave_group()
    del store  # rank 0 hosted the store until both ranks were done with it


def test_two_ranks_committing_one_shard_raise_the_census_error_and_take_no_optimizer_step():
    from tests.helpers.ranks import run_ranks

    results = run_ranks(_two_ranks_commit_one_shard, 2)
    for rank in range(2):
        assert results[rank, "bad"] == "step 0: shards not committed exactly once: {1: 2.0, 3: 0.0}"
        assert results[rank, "unchanged"]  # no optimizer step, the replica still at step 0
        assert results[rank, "good"] == (SHARDS, 1, True)  # the same replicas step under a right plan


def test_a_rewind_takes_back_the_steps_after_the_checkpoint():
    ledger = CommitLedger(SHARDS)
    for step in range(5):
        ledger.commit(step, StepRecord.of(step, [_report(0, (0, 1, 2, 3), step=step)]), complete=True)
    assert (ledger.steps_done, ledger.samples, ledger.shards_committed) == (5, 5 * 2 * SHARDS, 5 * SHARDS)
    ledger.rewind_to(3)
    assert (ledger.steps_done, ledger.samples, ledger.shards_committed) == (3, 3 * 2 * SHARDS, 3 * SHARDS)
    ledger.commit(3, StepRecord.of(3, [_report(0, (0, 1, 2, 3), step=3)]), complete=True)
    assert (ledger.steps_done, ledger.samples) == (4, 4 * 2 * SHARDS)
    with pytest.raises(ValueError, match="only 4 are done"):
        ledger.rewind_to(5)
