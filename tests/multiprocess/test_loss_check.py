"""A user's loss tried before Ray starts, in a child process (``orchestrator/job/loss_check.py``):
none for a built-in loss; a loss that returns the batch's mean is refused with a ConfigError
naming the job; one that keeps the contract passes; the child is killed, with the process group
of whatever it started, when its answer is in, at its budget, or when the trial is left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.job import loss_check
from orchestrator.job.loss_check import LossTrial

#: A download's helper process: a heartbeat (a counter) in its directory every 0.05 s, 60 s at most.
HEARTBEAT = """
import pathlib, sys, time
beat = pathlib.Path(sys.argv[1]) / "beat"
for count in range(1200):
    beat.write_text(str(count))
    time.sleep(0.05)
"""


def per_sample_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The contract kept: one loss per sample."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="none")


def dataset_with_a_helper(directory: str) -> torch.utils.data.TensorDataset:
    """A dataset factory that leaves a helper process running (as a downloader's may), once it
    has beaten at least once."""
    subprocess.Popen([sys.executable, "-c", HEARTBEAT, directory])
    beat = Path(directory) / "beat"
    while not beat.exists():
        time.sleep(0.01)
    return torch.utils.data.TensorDataset(torch.zeros(4, 64), torch.zeros(4, dtype=torch.int64))


class Spawned(list):
    """Stands in for ``subprocess.Popen`` in the module: starts the process and keeps it."""

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(*args, **kwargs)
        self.append(process)
        return process


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Spawned:
    children = Spawned()
    kept = {name: getattr(subprocess, name) for name in ("PIPE", "DEVNULL", "TimeoutExpired")}
    monkeypatch.setattr(loss_check, "subprocess", types.SimpleNamespace(**kept, Popen=children))
    return children


def job(**fields: Any) -> JobConfig:
    return JobConfig.model_validate(fields)


def test_a_builtin_loss_is_not_tried_in_a_child(spawned: Spawned) -> None:
    with LossTrial(job(), "job.yaml") as trial:  # cross_entropy keeps the contract
        trial.settle(60.0)
    assert spawned == []


def test_a_loss_returning_the_batch_mean_is_refused_with_a_config_error_naming_the_job(spawned: Spawned) -> None:
    with LossTrial(job(loss="tests.helpers.losses:mean_loss"), "job.yaml") as trial:
        with pytest.raises(ConfigError, match=r"^invalid job \(job\.yaml\):\n.*returned a scalar"):
            trial.settle(120.0)
    (child,) = spawned
    assert child.returncode is not None  # reaped


def test_a_loss_keeping_the_contract_passes_and_what_the_check_started_is_killed_with_it(
    spawned: Spawned, tmp_path: Path
) -> None:
    dataset = {"factory": dataset_with_a_helper, "kwargs": {"directory": str(tmp_path)}}
    checked = job(loss=per_sample_loss, dataset=dataset)
    with LossTrial(checked, "job.yaml") as trial:
        trial.settle(120.0)  # no ConfigError
    beat = tmp_path / "beat"
    assert beat.exists(), "the check ran the dataset factory"
    time.sleep(0.2)  # a write under way when the group was killed lands by now
    before = beat.read_text()
    time.sleep(0.5)
    assert beat.read_text() == before, "the helper the check started is still running"


def test_a_check_still_running_at_its_budget_passes_and_its_child_is_killed(spawned: Spawned) -> None:
    with LossTrial(job(loss="tests.helpers.losses:mean_loss"), "job.yaml") as trial:
        started = time.monotonic()
        trial.settle(0.2)  # far too short to even import torch: no verdict, left to the workers
        assert time.monotonic() - started < loss_check.REAP_S
    (child,) = spawned
    assert child.returncode == -signal.SIGKILL


def test_leaving_the_trial_kills_a_child_never_handed_the_job(spawned: Spawned) -> None:
    with LossTrial(job(loss="tests.helpers.losses:mean_loss"), "job.yaml"):
        pass  # the launch failed before the job was checked
    (child,) = spawned
    assert child.returncode == -signal.SIGKILL
