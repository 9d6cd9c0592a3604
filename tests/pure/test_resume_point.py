"""Where a run resumes (``orchestrator/checkpoints/resume_point.py``): a checkpoint written
before ``dataset.shuffle`` existed resumes in the epoch order it was written with."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.checkpoints.resume_point import config_hash, find_resume_point, trajectory_config
from workers.checkpoint.manifest import write_manifest
from workers.checkpoint.storage import CheckpointStorage

#: The hash every checkpoint of the built-in job carried before ``dataset.shuffle`` existed
#: (computed by the code of 8a7d3e5): the hash a run resumes by must not move under it.
BUILT_IN_BEFORE_SHUFFLE = "c37f92b80c37f2431985a568451c06fadbc6ad92306c9867a565ac8dd6da9789"


def _with_shuffle(job: JobConfig, shuffle: str) -> JobConfig:
    return job.model_copy(update={"dataset": job.dataset.model_copy(update={"shuffle": shuffle})})


def _old_run(run_dir: Path) -> None:
    """A run directory (from before run ids: its checkpoints flat under ``checkpoints/``) whose
    one checkpoint, after 4 steps, an old run of the built-in job wrote."""
    meta = {"config_hash": BUILT_IN_BEFORE_SHUFFLE, "config": trajectory_config(_with_shuffle(JobConfig(), "permutation"))}
    write_manifest(CheckpointStorage(str(run_dir / "checkpoints")), 4, [], meta)


def test_whole_epoch_permutations_hash_as_before_and_index_shuffles_do_not():
    job = JobConfig()
    assert job.dataset.shuffle == "index"
    assert config_hash(_with_shuffle(job, "permutation")) == BUILT_IN_BEFORE_SHUFFLE
    assert config_hash(job) != BUILT_IN_BEFORE_SHUFFLE


def test_an_old_run_resumes_in_whole_epoch_permutations_where_the_job_leaves_shuffle_unset(tmp_path):
    _old_run(tmp_path)
    warnings: list[str] = []
    point = find_resume_point(JobConfig(), tmp_path, warnings.append)
    assert point is not None and point.step == 4
    assert point.job.dataset.shuffle == "permutation" and "shuffle" in point.job.dataset.model_fields_set
    assert warnings == ["resuming with dataset.shuffle: permutation, the epoch order its checkpoint was written with"]
    assert point.job == _with_shuffle(JobConfig(), "permutation")


def test_an_old_run_asked_for_index_shuffles_is_refused_naming_the_dataset(tmp_path):
    _old_run(tmp_path)
    with pytest.raises(ConfigError, match=r"differs in \['dataset'\]"):
        find_resume_point(_with_shuffle(JobConfig(), "index"), tmp_path, print)


def test_a_new_run_resumes_as_it_is_with_no_message(tmp_path):
    job = JobConfig()
    write_manifest(CheckpointStorage(str(tmp_path / "checkpoints")), 4, [], {"config_hash": config_hash(job)})
    warnings: list[str] = []
    point = find_resume_point(job, tmp_path, warnings.append)
    assert point is not None and point.job is job and warnings == []


def test_credentials_in_data_uris_do_not_enter_the_trajectory_hash():
    """Keys rotate; the data is guarded by its index (orchestrator/data/index.py), not the hash."""
    def files(uri: str) -> JobConfig:
        return JobConfig(dataset={"files": uri, "format": "tokens", "seq_len": 8})

    one = files("s3://old:one@bucket/t/*.bin?endpoint_override=h:1")
    assert config_hash(one) == config_hash(files("s3://new:two@bucket/t/*.bin?endpoint_override=h:1"))
    assert config_hash(one) != config_hash(files("s3://old:one@bucket/other/*.bin?endpoint_override=h:1"))
