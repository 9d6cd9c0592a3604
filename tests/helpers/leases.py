"""Reading and writing a checkpoint namespace's lease file in tests, as a driver would."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from orchestrator.checkpoints.lease import LEASE_FILE


def lease_file(root: Path) -> dict:
    """The lease in the namespace ``root``, parsed."""
    return json.loads((root / LEASE_FILE).read_text())


def put_lease(root: Path, lease: dict) -> None:
    """Write ``lease`` as a driver does, whole (a temp file renamed over it): a refresher
    reading every 50 ms must never see it truncated."""
    (root / "lease.tmp").write_text(json.dumps(lease))
    os.replace(root / "lease.tmp", root / LEASE_FILE)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s}s for {what}"
        time.sleep(0.02)
