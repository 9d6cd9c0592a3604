"""Bad input answered in one line before Ray starts: exit 2 from the CLI, ConfigError from the
API, naming the field or file; and a local run that does not warn its user about the Ray it
started for itself."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ringleader
from ringleader.cli import main
from tests.helpers.losses import mean_loss
from tests.helpers.paths import REPO


class HugeModel(torch.nn.Module):
    """The digits' classifier beside a 4 PB buffer: no driver could build it, a model built
    shape-only (on the meta device) costs nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.register_buffer("huge", torch.empty(10**15))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)


#: A download's helper process: it writes a heartbeat (a counter) into its directory every 0.1 s, 60 s at most.
HEARTBEAT = """
import pathlib, sys, time
beat = pathlib.Path(sys.argv[1]) / "beat"
for count in range(600):
    beat.write_text(str(count))
    time.sleep(0.1)
"""


def downloading_dataset(directory: str) -> torch.utils.data.TensorDataset:
    """A dataset factory that downloads for a minute, in a helper process it started (as a
    downloader's may); ``directory/started`` says it was called."""
    (Path(directory) / "started").touch()
    subprocess.run([sys.executable, "-c", HEARTBEAT, directory], timeout=90)
    return torch.utils.data.TensorDataset(torch.zeros(4, 64), torch.zeros(4, dtype=torch.int64))


@pytest.fixture
def ray_never_starts(monkeypatch):
    """Whatever this process's Ray is doing, the code under test sees none, and starting or
    joining one fails the test."""
    import ray

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _job_file(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "job.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


SMALL = "steps: 2\neval: null\nshards: 2\nbatch_size: 8\nscaling: {workers: 1}\n"


@pytest.mark.parametrize(
    "text, extra, expected",
    [
        (SMALL + "optimizer: {kwargs: {lr: fast}}\n", [], "field 'optimizer.kwargs': lr: expected a number, got 'fast'"),
        (SMALL + "optimizer: {name: sgd, kwargs: {lr: 1e-3}}\n", [], "got '1e-3' (YAML reads 1e-3 as text: write 1.0e-3)"),
        (b"name: caf\xe9\n", [], "is not UTF-8 text (byte 0xe9 at offset 9)"),
        (SMALL, ["--address", "127.0.0.1:{port}"], "address 127.0.0.1:{port}: no Ray cluster answers there (Connection refused)"),
        (SMALL + "loss: tests.helpers.losses:mean_loss\n", [], "field 'loss' (tests.helpers.losses:mean_loss) returned a scalar"),
        (SMALL, ["--local-nodes", "-1"], "local_nodes (--local-nodes): expected an integer >= 0, got -1"),
    ],
    ids=["lr-text", "lr-1e-3", "not-utf8", "no-cluster", "scalar-loss", "local-nodes"],
)
def test_the_cli_refuses_bad_input_with_exit_2_before_ray_starts(tmp_path, capsys, ray_never_starts, text, extra, expected):
    port = _free_port()
    path = _job_file(tmp_path, text)
    args = [arg.format(port=port) for arg in extra]
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run"), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert expected.format(port=port) in err
    assert "Traceback" not in err and err.startswith("ringleader: ")
    if "address" not in expected and "local_nodes" not in expected:
        assert str(path) in err
    assert not (tmp_path / "run").exists()


def _small_job() -> dict:
    return {"steps": 2, "eval": None, "shards": 2, "batch_size": 8, "scaling": {"workers": 1}}


@pytest.mark.parametrize(
    "job, options, expected",
    [
        ({}, {"overrides": "steps=50"}, "overrides: expected a list of 'FIELD=VALUE' strings, e.g. overrides=['steps=50'], got"),
        ({}, {"local_nodes": -1}, "local_nodes (--local-nodes): expected an integer >= 0, got -1"),
        ({"loss": mean_loss}, {}, "returned a scalar, the batch's mean or sum: return per-sample losses of shape [2]"),
        # Not importable by name (the check's process gets it pickled by value, as Ray's workers do).
        ({"loss": lambda model, batch: mean_loss(model, batch)}, {}, "returned a scalar, the batch's mean or sum"),
        ({"optimizer": {"name": "RAdam", "kwargs": {"lr": "fast"}}}, {}, "field 'optimizer.kwargs': lr: expected a number"),
    ],
    ids=["overrides-string", "local-nodes", "scalar-loss", "scalar-lambda", "lr-text"],
)
def test_the_api_raises_config_error_before_ray_starts(tmp_path, ray_never_starts, job, options, expected):
    with pytest.raises(ringleader.ConfigError) as err:
        ringleader.run({**_small_job(), **job}, tmp_path / "run", **options)
    assert expected in str(err.value)
    assert not (tmp_path / "run").exists()


def test_resume_refuses_overrides_given_as_a_string(tmp_path):
    (tmp_path / "job.json").write_text("{}")
    with pytest.raises(ringleader.ConfigError, match=r"^overrides: expected a list"):
        ringleader.resume(tmp_path, overrides="steps=50")


def test_a_loss_returning_per_sample_losses_or_a_sum_and_weight_passes_the_check():
    from jobspec.job import JobConfig
    from orchestrator.job.reading import check_loss

    h = "tests.helpers.losses"
    check_loss(JobConfig.model_validate({"loss": f"{h}:exploding_loss"}), "job")  # [n] (infinite, but the shape is right)
    check_loss(JobConfig.model_validate({"loss": f"{h}:nan_weight_loss"}), "job")  # a pair: its weight is the workers' to refuse
    check_loss(JobConfig.model_validate({"loss": "json:dumps"}), "job")  # raises on the call: left to the workers


def test_a_scalar_loss_is_refused_on_a_model_too_large_for_the_driver():
    """The model is built on the meta device: shapes, no memory (a real build raises)."""
    from jobspec.job import JobConfig
    from orchestrator.job.reading import check_loss

    with pytest.raises(RuntimeError):  # what building it for real does here
        HugeModel()
    job = JobConfig.model_validate({"loss": mean_loss, "model": {"factory": HugeModel}})
    with pytest.raises(ringleader.ConfigError, match="returned a scalar"):
        check_loss(job, "job")


def test_a_slow_dataset_factory_delays_the_launch_by_the_loss_check_budget_only_and_stops_then(
    tmp_path, ray_never_starts, monkeypatch
):
    """The check runs the dataset factory; one that takes minutes (a download) must not hold
    the launch past LOSS_CHECK_S, nor end it in a LaunchTimeout: Ray starts (here: is refused).
    Nor may it download on past it, helpers included, beside the workers' own download."""
    from orchestrator import launch

    monkeypatch.setattr(launch, "LOSS_CHECK_S", 10.0)  # time for the check to import torch and reach the factory
    monkeypatch.setattr(launch, "PRELOAD_TIMEOUT_S", 40.0)
    job = {**_small_job(), "loss": mean_loss, "dataset": {"factory": downloading_dataset, "kwargs": {"directory": str(tmp_path)}}}
    started = time.monotonic()
    with pytest.raises(AssertionError, match="Ray was started"):
        ringleader.run(job, tmp_path / "run")
    assert time.monotonic() - started < 30
    assert (tmp_path / "started").exists()  # the check did run the factory
    beat = tmp_path / "beat"
    before = beat.read_text() if beat.exists() else None
    time.sleep(1.0)
    assert (beat.read_text() if beat.exists() else None) == before, "the check's download went on past its budget"


def test_a_failed_torch_import_ends_the_launch_at_once_with_the_import_error(tmp_path, ray_never_starts, monkeypatch):
    from orchestrator import launch

    monkeypatch.setattr(launch, "PRELOAD_TIMEOUT_S", 20.0)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ImportError
    started = time.monotonic()
    with pytest.raises(ImportError, match="torch"):
        ringleader.run({**_small_job(), "loss": mean_loss}, tmp_path / "run")
    assert time.monotonic() - started < 15


def test_overrides_none_means_no_overrides(tmp_path, ray_never_starts):
    """None is what a caller passes for "no overrides": the launch goes on, to the scalar loss check."""
    job = {**_small_job(), "loss": "tests.helpers.losses:mean_loss"}
    with pytest.raises(ringleader.ConfigError, match="returned a scalar"):
        ringleader.run(job, tmp_path / "run", overrides=None)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "job.json").write_text(json.dumps(job))
    with pytest.raises(ringleader.ConfigError, match="returned a scalar"):
        ringleader.resume(tmp_path / "earlier", overrides=None)


QUIET_START = """
import os
from orchestrator.launch import ray_session
with ray_session(None):
    print("auth mode:", os.environ.get("RAY_AUTH_MODE"))
"""


def test_a_local_run_does_not_warn_about_the_token_auth_of_its_own_ray(private_ray_home):
    done = subprocess.run(
        [sys.executable, "-c", QUIET_START], env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "auth mode: token" in done.stdout  # Ray's default, token authentication, is kept
    assert "Token authentication is enabled" not in done.stdout + done.stderr


def test_a_generic_optimizer_that_cannot_step_slices_is_refused_before_any_worker_starts():
    """Sharded state steps 1-D pieces of parameters: Adafactor (which factors a matrix's
    moments) is refused in one line naming sharding.group_size by the import-heavy checks that
    run beside Ray's start (``resolve_job``), before any actor starts; RAdam passes."""
    from orchestrator.job.reading import load_job, resolve_job

    job = load_job(None, ["optimizer.name=Adafactor", "sharding.group_size=2"], resolve=False)
    with pytest.raises(ringleader.ConfigError, match=r"field .sharding.group_size.: Adafactor cannot step slices of parameters"):
        resolve_job(job, "job")
    resolve_job(load_job(None, ["optimizer.name=RAdam", "sharding.group_size=2"], resolve=False), "job")
