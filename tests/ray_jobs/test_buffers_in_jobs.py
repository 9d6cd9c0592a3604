"""Model buffers (BatchNorm) in whole jobs on Ray: exact through a SIGKILL, steals, backups,
a rescue, and a resume on another worker count."""

from __future__ import annotations

import pytest
import ray
import torch

from jobspec.step_record import read_telemetry
from orchestrator.group.ray_group import RayWorkerGroup
from tests.helpers.jobs import Reference, assert_same_params, jsonl, params, run

BN = "norm"  # the BatchNorm layer of make_norm_cnn
STEPS = 12

NORM_JOB = (f"steps={STEPS}", "model.factory=tests.helpers.factories:make_norm_cnn", "model.kwargs={channels: 4}")


@pytest.fixture(scope="module")
def norm_alone(one_worker) -> Reference:
    """The BatchNorm CNN's state after a clean single-worker run (fuse_shards on, the default),
    with its yardstick: the shards' passes (one per shard, the layer forces it) in another order."""
    return one_worker(*NORM_JOB)


@pytest.fixture
def replicas(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Every replica's state when the run ends, rank 0's first: the driver, about to save rank
    0's as model.pt, asks every member of the group for its own (the actors' ``model_state``)."""
    states: list[dict[str, torch.Tensor]] = []

    def every_replica(group: RayWorkerGroup, timeout_s: float) -> dict[str, torch.Tensor]:
        states[:] = ray.get([actor.model_state.remote() for actor in group.actors], timeout=timeout_s)
        return states[0]

    monkeypatch.setattr(RayWorkerGroup, "model_state", every_replica)
    return states


def _assert_same_state(run_dir, alone: Reference, name: str, replicas: list[dict[str, torch.Tensor]], workers: int) -> None:
    """Parameters and buffers as the single worker's, the statistics counted once per step, and
    every replica (at least ``workers``) left with exactly rank 0's, saved as model.pt."""
    spread = params(run_dir)
    assert {f"{BN}.running_mean", f"{BN}.running_var", f"{BN}.num_batches_tracked"} <= spread.keys()
    assert_same_params(spread, alone, name)
    assert int(spread[f"{BN}.num_batches_tracked"]) == STEPS  # once per step, a redone one too
    assert len(replicas) >= workers, f"{name}: {len(replicas)} replicas at the end"
    for rank, state in enumerate(replicas):
        assert state.keys() == spread.keys()
        for key, value in spread.items():
            assert torch.equal(state[key], value), f"{name}: rank {rank}'s {key} is not rank 0's"


def test_batchnorm_parameters_and_buffers_match_on_one_and_three_workers_across_a_sigkill(tmp_path, norm_alone, replicas):
    """The batch-dependent layer forces a pass per shard although fuse_shards is on. Worker 0
    dies late, so the group re-forms around a replica that was never rank 0 and takes its state."""
    killed = run(tmp_path, "w3", *NORM_JOB, "scaling.workers=3", "chaos.kill=[{at_step: 9, worker: 0, how: sigkill}]")
    assert killed.summary["events"]["failures"] == 1 and killed.summary["events"]["recoveries"] == 1
    _assert_same_state(killed.run_dir, norm_alone, "1 vs 3 workers, worker 0 SIGKILLed", replicas, 2)


def test_batchnorm_buffers_count_each_shard_once_through_steals_backups_and_a_rescue(tmp_path, norm_alone, replicas):
    result = run(
        tmp_path, "w3-chaos", *NORM_JOB, "scaling.workers=3", "stragglers.evict=false",
        "chaos={slow: [{worker: 2, factor: 8, from_step: 1, to_step: 3}], stall: [{worker: 1, at_step: 10, seconds: 5}]}",
        # Quick to suspect and quick to call a shard late, so stealing and backups race a lot.
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1", "stragglers.window=2",
    )
    events = result.summary["events"]
    # Work moved between replicas (steals always; backups in most runs, but on a loaded machine
    # the slow worker may finish before any shard is called late: not required).
    assert events["stolen_shards"] > 0, events
    # Worker 1 stopped waiting for its data: its shards went to the rescue pass (or, were it
    # suspected by then on a busy machine, were stolen within the step).
    assert any(r["gave_up"] for r in read_telemetry(result.run_dir / "telemetry.jsonl") if r["step"] == 10)
    _assert_same_state(result.run_dir, norm_alone, "1 vs 3 workers, steals, backups and a rescue", replicas, 3)


def test_batchnorm_buffers_resume_from_a_checkpoint_on_another_worker_count(tmp_path, norm_alone, replicas):
    model = NORM_JOB[1:]
    run(tmp_path, "run", *model, "steps=6", "scaling.workers=2", "checkpoint.every_steps=3")
    resumed = run(tmp_path, "run", *model, f"steps={STEPS}", "scaling.workers=3", "checkpoint.every_steps=3")
    assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000006"]
    _assert_same_state(resumed.run_dir, norm_alone, "2 workers, resumed on 3", replicas, 3)
