"""One local Ray cluster for the whole test session, isolated from anything else on the machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator

import pytest


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
