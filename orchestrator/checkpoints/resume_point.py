"""Where a run resumes: the newest valid checkpoint of its own trajectory, known by a hash of the
job fields that decide the trajectory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from jobspec.redaction import redact_all
from orchestrator.checkpoints.namespace import run_namespace
from workers.checkpoint.manifest import latest_valid
from workers.checkpoint.storage import CheckpointStorage

# Fields of a job that decide its trajectory: a checkpoint resumes only a job that agrees on
# them. Worker counts, timeouts, straggler handling, chaos and ``steps`` (to extend a run) may
# change.
TRAJECTORY_FIELDS = ("model", "dataset", "loss", "optimizer", "batch_size", "shards", "seed", "epochs", "collective", "worker")


def trajectory_config(job: JobConfig) -> dict[str, Any]:
    config = job.model_dump(mode="json", include=set(TRAJECTORY_FIELDS))
    config["collective"] = {k: config["collective"][k] for k in ("compression", "topk_ratio")}
    # Fields added since the first checkpoints enter only when they differ from their default,
    # so those checkpoints keep their hash. The pass size, like the worker count, only moves
    # float summation order (for a model with dropout it also changes the masks): a run may
    # resume on smaller devices with smaller passes.
    del config["worker"]["max_samples_per_pass"]
    # Compiling, like the pass size, moves only float order: either way resumes the other.
    del config["model"]["compile"]
    if config["dataset"]["collate"] is None:
        del config["dataset"]["collate"]
    if config["dataset"]["shuffle"] == "permutation":  # the one order before ``shuffle`` existed
        del config["dataset"]["shuffle"]
    # How far ahead a stream's feeder holds rows moves no sample.
    del config["dataset"]["ahead_steps"]
    for key, default in (
        ("files", None), ("format", None), ("dtype", "uint16"), ("seq_len", None), ("column", None), ("ray_data", None),
    ):
        if config["dataset"][key] == default:
            del config["dataset"][key]
    if "files" in config["dataset"]:  # credentials may rotate; the data itself is guarded by its index
        config["dataset"]["files"] = redact_all(config["dataset"]["files"])
    if not job.loss.kwargs:
        config["loss"] = config["loss"]["name"]
    for key, default in (("decay_biases_and_norms", True), ("clip_grad_norm", None)):
        if config["optimizer"][key] == default:
            del config["optimizer"][key]
    if not job.schedule.is_default:
        config["schedule"] = job.schedule.model_dump(mode="json", exclude_none=True)
    if job.precision != "fp32":
        config["precision"] = job.precision
    if job.precision == "fp16":
        config["loss_scaling"] = job.loss_scaling.model_dump(mode="json")
    return config


def config_hash(job: JobConfig) -> str:
    return hashlib.sha256(json.dumps(trajectory_config(job), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to go on from: after ``step`` steps; ``skipped`` lists the
    messages about newer checkpoints that failed verification; ``job``: the job as it resumes
    (the one asked, with the epoch order its checkpoint was written with where it left
    ``dataset.shuffle`` unset)."""

    root: str
    name: str
    step: int
    manifest: dict[str, Any]
    skipped: list[str]
    job: JobConfig

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]


def find_resume_point(job: JobConfig, run_dir: Path, warn: Callable[[str], None]) -> ResumePoint | None:
    """The newest good checkpoint of the run in ``run_dir`` (in its namespace: ``run_namespace``),
    or None if there is none. Bad ones are reported through ``warn`` and skipped. Raises
    ConfigError if that checkpoint was written with another trajectory than ``job``'s
    (``TRAJECTORY_FIELDS``), or if ``run_dir`` is a copy of the run directory that owns the
    namespace (``check_owner``: the copy would overwrite and prune its checkpoints)."""
    root = run_namespace(job, run_dir)
    storage = CheckpointStorage(root)
    skipped: list[str] = []

    def note(message: str) -> None:
        skipped.append(message)
        warn(message)

    found = latest_valid(storage, note)
    if found is None:
        return None
    name, manifest = found
    saved = manifest["meta"].get("config", {})
    job = _as_written(job, manifest["meta"].get("config_hash"), warn)
    if manifest["meta"].get("config_hash") != config_hash(job):
        mine = trajectory_config(job)
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        raise ConfigError(
            f"checkpoint {storage.location(name)} was written by a job that differs in {differ}; "
            "a run resumes only with the same model, data, optimizer, batch, shards and seed"
        )
    return ResumePoint(root, name, int(manifest["step"]), manifest, skipped, job)


def _as_written(job: JobConfig, saved_hash: str | None, warn: Callable[[str], None]) -> JobConfig:
    """``job``, or, where it leaves ``dataset.shuffle`` unset and its checkpoint was written by a
    run that drew whole-epoch permutations (before ``index`` existed), ``job`` with that order:
    an old run resumes on the trajectory it started."""
    if "shuffle" in job.dataset.model_fields_set or saved_hash == config_hash(job):
        return job
    dataset = job.dataset.model_copy(update={"shuffle": "permutation"})
    older = job.model_copy(update={"dataset": dataset})
    if saved_hash != config_hash(older):
        return job
    warn("resuming with dataset.shuffle: permutation, the epoch order its checkpoint was written with")
    return older
