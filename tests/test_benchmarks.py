"""The throughput benchmark's runners: each produces a row, and all three train the same model
to the same loss, which is what makes the comparison fair."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest

from benchmarks.throughput import FRAMEWORKS, format_table, medians, run_once
from benchmarks.workloads import workload_job


@pytest.fixture
def private_ray_home(tmp_path, monkeypatch):
    # Every runner starts its own local Ray; keep their token and sockets out of ~ and /tmp/ray
    # (in a short directory: Ray's socket paths must fit in 107 bytes).
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlb-", dir="/tmp"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    yield
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.usefixtures("private_ray_home")
def test_each_runner_gives_a_row_and_all_reach_the_same_loss(tmp_path):
    job = workload_job("digits", workers=2, steps=4)
    # Half a CPU each: the test suite's machine has two cores for everything.
    job = job.model_copy(update={"scaling": job.scaling.model_copy(update={"resources_per_worker": {"CPU": 0.5}})})
    rows = [run_once(framework, job, tmp_path / framework) for framework in FRAMEWORKS]
    for row in rows:
        assert row.first_step_s > 0 and row.step_s > 0 and row.samples_per_s > 0 and row.wall_s > row.first_step_s
        assert row.eval_loss is not None and math.isfinite(row.eval_loss)
    ours = rows[0].eval_loss
    for row in rows[1:]:
        assert row.eval_loss == pytest.approx(ours, rel=1e-4), f"{row.framework} trained a different model"
    table = medians(rows)
    assert set(table["digits"]) == set(FRAMEWORKS)
    assert "ours/ray_train" in format_table(table)
