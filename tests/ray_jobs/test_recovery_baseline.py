"""The Ray Train recovery baseline: a worker SIGKILLed mid-step is restarted by Ray Train's
FailureConfig from the last checkpoint, and the numbers the benchmark reports come out right."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.ddp_loop import train_ddp
from benchmarks.recovery import param_diff
from benchmarks.recovery_baseline import run_ray_train_recovery
from benchmarks.workloads import workload_job


@pytest.mark.usefixtures("private_ray_home")
def test_ray_train_restarts_from_the_last_checkpoint_and_trains_the_same_model(tmp_path):
    job = workload_job("digits", workers=2, steps=8)
    # A tiny model and half a CPU a worker: the test suite's machine has two cores for everything.
    job = job.model_copy(
        update={
            "model": job.model.model_copy(update={"kwargs": {"hidden": 16, "depth": 1}}),
            "scaling": job.scaling.model_copy(update={"resources_per_worker": {"CPU": 0.5}}),
        }
    )
    result = run_ray_train_recovery(job, tmp_path, kill_step=5, kill_rank=1, checkpoint_every=2)

    # Checkpoints after steps 1 and 3 (step = 2, 4 completed); rank 1 dies in step 5, so the
    # restart resumes at step 4 and recomputes the one committed step lost (step 4).
    assert result["attempts"] == 2, "Ray Train's FailureConfig did not restart the worker group"
    assert result["resumed_from"] == 4 and result["first_step_after"] == 4
    assert result["steps_lost"] == 1
    assert 0 < result["restart_s"] < result["recovery_s"] < result["wall_s"]
    assert [s for s, _, attempt in result["steps"] if attempt == 2] == [4, 5, 6, 7]

    # Resuming restored model, optimizer and data order: the same model as training straight
    # through (one process here, so equal up to float summation order).
    reference = train_ddp(job, rank=0, world=1, wrap=lambda model: model)
    assert math.isfinite(result["final_loss"])
    assert result["final_loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-4)
    # What the recovery benchmark reports: nothing dropped, whole group back at once, and rank
    # 0's saved final parameters equal the uninterrupted run's.
    assert result["samples_dropped"] == 0 and result["full_size_s"] == result["recovery_s"]
    torch.save(reference["model"], tmp_path / "reference.pt")
    diff, exact = param_diff(tmp_path / "model.pt", tmp_path / "reference.pt")
    assert exact, f"parameters differ by {diff}"
