"""A failure in the middle of a batch of run-ahead steps: the steps before it that every
replica applied are committed (summary, ``step`` events, ``telemetry.jsonl``) and the error
names the step that failed, not the batch's first."""

from __future__ import annotations

import pytest

from jobspec.step_record import read_telemetry
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from tests.helpers.fake_group import Faults
from tests.helpers.fake_runs import Ran
from tests.helpers.jobs import jsonl
from tests.helpers.poisoned_data import poisoned_index

FAILING = 10  # in the batch of steps 8-15 (batches of 1, 1, 2, 4 and 8 steps while quiet)


def _assert_committed_through_the_failure(run_dir, summary: dict, failing: int) -> None:
    assert summary["status"] == "failed"
    assert summary["steps"] == failing, summary.get("error")
    assert [e["step"] for e in jsonl(run_dir / "events.jsonl") if e["event"] == "step"] == list(range(failing))
    telemetry = read_telemetry(run_dir / "telemetry.jsonl")
    assert sorted({r["step"] for r in telemetry}) == list(range(failing))


@pytest.mark.parametrize(
    "faults, overrides, error, recovering",
    [
        (Faults(error_in_step={(1, FAILING): "bad data"}), (), f"JobFailed: step {FAILING}: ValueError: bad data", 1),
        # Every worker stalls in the step: no progress within step_s.
        (Faults(stall={(1, FAILING): 60.0}), ("timeouts.step_s=1",), f"JobFailed: step {FAILING} did not finish within 1s", 0),
    ],
    ids=["user-error", "step-timeout"],
)
def test_a_failure_inside_a_batch_commits_the_steps_before_it_and_names_its_step(tmp_path, faults, overrides, error, recovering):
    ran = Ran(tmp_path, faults, overrides)
    assert (8, 8) in ran.group.batches  # the failing step was in the middle of a batch
    _assert_committed_through_the_failure(ran.run_dir, ran.summary, FAILING)
    assert ran.summary["error"] == error
    # Where a failure was seen (entering Recovering) is the whole batch, not its first step.
    reasons = [e["reason"] for e in ran.of("state") if e["new"] == "recovering"]
    assert len(reasons) == recovering
    assert all(r.startswith("the batch of steps 8-15 failed: ") for r in reasons)


@pytest.mark.usefixtures("ray_cluster")
def test_a_loss_turned_non_finite_inside_a_batch_on_ray_keeps_the_steps_before_it(tmp_path):
    n, batch_size, shards = 1024, 32, 4
    job = load_job(None, [
        "model={factory: 'tests.helpers.losses:make_regressor'}",
        f"dataset={{factory: 'tests.helpers.poisoned_data:make_poisoned_dataset', "
        f"kwargs: {{n: {n}, poisoned: {poisoned_index(n, batch_size, shards, FAILING)}}}}}",
        "loss=mse", f"batch_size={batch_size}", f"shards={shards}", "steps=20", "eval=null", "scaling.workers=2",
        # Nobody is ever a straggler on a shared machine: batches grow to 8 steps (8-15).
        "stragglers={rebalance: false, min_ratio: 1000, threshold: 1000}",
    ])
    result = run_job(job, run_dir=tmp_path / "poisoned")
    _assert_committed_through_the_failure(result.run_dir, result.summary, FAILING)
    assert result.summary["error"].startswith(f"JobFailed: step {FAILING}: FloatingPointError: step {FAILING}: the reduced gradient")
