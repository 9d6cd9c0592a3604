"""A private HOME and RAY_TMPDIR for code under test whose subprocesses start their own Ray."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def private_ray_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """While inside: HOME is ``home`` (created) and RAY_TMPDIR a fresh short directory (removed
    after), so a Ray a subprocess starts keeps its token and sockets out of ~ and /tmp/ray (Ray's
    socket paths must fit in 107 bytes); and as from a fresh shell: without ``RAY_AUTH_MODE``
    (the session's ``ray.init`` exported ``RAY_AUTH_MODE=token``, which makes a new head node
    insist on a token the private HOME does not have yet) or ``RAY_ADDRESS``. ``monkeypatch``
    restores the environment when it is undone."""
    for key in ("RAY_AUTH_MODE", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlb-", dir="/tmp"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    try:
        yield
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
