"""The devices a GPU-suite test runs on: ``cpu`` always (CI proves the test's logic there) and
``cuda``, marked ``gpu`` (``pytest -m gpu``; skipped with the reason where there is no CUDA
device, by ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def worker_resources(device: str, share: int = 1) -> str:
    """The ``scaling.resources_per_worker`` override for workers on ``device``; ``share``
    workers share one GPU (over gloo: NCCL refuses two ranks on one device)."""
    if device == "cpu":
        return "scaling.resources_per_worker={CPU: 0.5}"
    return f"scaling.resources_per_worker={{CPU: 0.5, GPU: {1 / share:.4f}}}"
