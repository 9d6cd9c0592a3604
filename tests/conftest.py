"""One local Ray cluster for the whole test session, isolated from anything else on the machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from tests.helpers.jobs import Reference


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A fresh local Ray (never an existing one) in its own temp dir and HOME.

    HOME is private so Ray's token auth (on by default in 2.60) writes its token there,
    not into the user's ~/.ray; RAY_TMPDIR is short because Ray's socket paths must be.
    """
    import ray

    scratch = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_TMPDIR")}
    os.environ["HOME"] = os.path.join(scratch, "home")
    os.environ["RAY_TMPDIR"] = os.path.join(scratch, "ray")
    os.makedirs(os.environ["HOME"])
    os.makedirs(os.environ["RAY_TMPDIR"])
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def private_ray_home(tmp_path, monkeypatch):
    """For tests whose subprocesses start their own Ray: ``tests.helpers.ray_home.private_ray_home``
    for the test (HOME ``tmp_path / "home"``)."""
    from tests.helpers.ray_home import private_ray_home as isolated

    with isolated(tmp_path / "home", monkeypatch):
        yield


@pytest.fixture(scope="session")
def one_worker(tmp_path_factory, ray_cluster) -> Callable[..., Reference]:
    """``one_worker(*overrides)``: the clean single-worker run of ``tests.helpers.jobs.run``'s
    job with ``overrides``, with the job's yardstick (``reference_run``: two runs). Run once a
    session for each ``overrides`` (the runs are deterministic, and tests only read them)."""
    from tests.helpers.jobs import reference_run

    done: dict[tuple[str, ...], Reference] = {}

    def reference_of(*overrides: str) -> Reference:
        if overrides not in done:
            done[overrides] = reference_run(tmp_path_factory.mktemp("ref"), *overrides)
        return done[overrides]

    return reference_of


@pytest.fixture(scope="session")
def reference(tmp_path_factory, one_worker) -> Reference:
    """The built-in job's one-worker run (``one_worker()``), which every run of it must match
    whatever happened to its workers; many modules compare against it. Its control is checked
    here, once: the same job with another seed ends far outside the bound."""
    from tests.helpers.jobs import assert_control_differs, params, run

    ran = one_worker()
    other_seed = run(tmp_path_factory.mktemp("control"), "seed1", "scaling.workers=1", "seed=1")
    assert_control_differs(params(other_seed.run_dir), ran, "the built-in job with seed 1")
    return ran


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu`` is skipped, saying why, where torch sees no CUDA device (CI)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
