"""Job files with one mistake each, and the check that ``ringleader run`` refuses one: exit 2 and one
line naming the field and the file, before any run directory exists."""

from pathlib import Path

import pytest
import yaml

from ringleader.cli import main


def write_job(tmp_path: Path, mapping: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


BAD_JOBS = [
    ({"steps": 10, "learning_rate": 0.1}, "'learning_rate': unknown field"),
    ({"scaling": {"workers": "many"}}, "'scaling.workers'"),
    ({"batch_size": -3}, "'batch_size'"),
    ({"model": {"factory": "no_such_module_xyz:make"}}, "'model.factory': cannot import module 'no_such_module_xyz'"),
    ({"model": {"factory": "not a path"}}, "'model.factory': expected 'package.module:function'"),
    ({"batch_size": 8, "shards": 16}, "shards (16) must not exceed batch_size (8)"),
    ({"shards": 2}, "shards (2) must be >= the most workers"),
    ({"scaling": {"workers": 5, "max_workers": 4}}, "min_workers <= workers <= max_workers"),
    ({"optimizer": {"name": "lamb!"}}, "'optimizer.name'"),
    ({"collective": {"algorithm": "butterfly"}}, "'collective.algorithm'"),
    ({"collective": {"compression": "zip"}}, "'collective.compression'"),
    ({"collective": {"topk_ratio": 2}}, "'collective.topk_ratio'"),
    ({"scaling": {"resources_per_worker": {"CPU": -1}}}, "'scaling.resources_per_worker'"),
    ({"steps": 10, "epochs": 2}, "exactly one of 'steps' and 'epochs'"),
    ({"chaos": {"slow": [{"worker": 9, "factor": 3}]}}, "chaos.slow.0.worker: 9 is not a worker"),
    ({"chaos": {"slow": [{"worker": 0, "factor": 0.5}]}}, "'chaos.slow.0.factor'"),
    ({"chaos": {"slow": [{"worker": 0, "factor": 2, "from_step": 5, "to_step": 5}]}}, "to_step (5) must be after from_step (5)"),
    ({"chaos": {"stall": [{"worker": 1, "at_step": 3}]}}, "'chaos.stall.0.seconds'"),
    ({"chaos": {"stall": [{"worker": 1, "rank": 1, "at_step": 3, "seconds": 1}]}}, "field 'chaos.stall.0': chaos.stall: set 'worker' only"),
    ({"chaos": {"stall": [{"worker": 1, "at_step": 3, "seconds": 1, "during": "sleep"}]}}, "'chaos.stall.0.during'"),
    ({"chaos": {"stalls": {"probability": 1.5, "seconds": 1}}}, "'chaos.stalls.probability'"),
    ({"chaos": {"stalls": {"probability": 0.1}}}, "'chaos.stalls.seconds'"),
    ({"stragglers": {"min_ratio": 1}}, "'stragglers.min_ratio'"),
    ({"loss": "hinge"}, "'loss.name': unknown loss 'hinge'"),
    ({"loss": {"name": "mse", "kwargs": {"ignore_index": 0}}}, "'loss.kwargs': loss 'mse' takes no arguments"),
    ({"schedule": {"name": "exponential"}}, "'schedule.name': unknown schedule 'exponential'"),
    ({"precision": "fp8"}, "'precision'"),
    ({"precision": "fp16", "collective": {"compression": "topk"}}, "precision fp16 cannot be combined with collective.compression topk"),
    ({"optimizer": {"clip_grad_norm": 0}}, "'optimizer.clip_grad_norm'"),
    ({"worker": {"max_samples_per_pass": 0}}, "'worker.max_samples_per_pass'"),
    ({"stragglers": {"window": 3, "persistent_steps": 4}}, "persistent_steps (4) must be <= window (3)"),
]


# Found only by importing user code and torch, which the CLI does while Ray starts.
DEEP_BAD_JOBS = [
    ({"dataset": {"factory": "ringleader_examples.digits:nope"}}, "'dataset.factory': module 'ringleader_examples.digits' has no attribute 'nope'"),
    ({"optimizer": {"name": "adam", "kwargs": {"learning_rate": 1}}}, "'optimizer.kwargs'"),
    ({"optimizer": {"name": "lamb"}}, "'optimizer.name': torch.optim has no optimizer 'lamb'"),
    (
        {"optimizer": {"name": "adam", "kwargs": {"weight_decay": 0.1, "maximize": True}, "decay_biases_and_norms": False}},
        "'optimizer.kwargs': adam with maximize cannot exempt biases and norms from weight decay",
    ),
    ({"optimizer": {"name": "RAdam", "kwargs": {"lr": 0.1, "momentum": 0.9}}}, "'optimizer.kwargs': RAdam: RAdam.__init__() got an unexpected keyword argument 'momentum'"),
    ({"loss": "tests.helpers.losses:nope"}, "'loss.name': module 'tests.helpers.losses' has no attribute 'nope'"),
    ({"schedule": {"name": "json:loads.nope"}}, "'schedule.name': module 'json' has no attribute 'loads.nope'"),
]


def assert_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], mapping: dict, expected: str) -> None:
    path = write_job(tmp_path, mapping)
    assert main(["run", path, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert path in err
    assert not (tmp_path / "run").exists()
