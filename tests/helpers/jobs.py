"""Running short jobs in tests and reading what they leave behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from orchestrator.job_file import load_job
from orchestrator.launch import run_job


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def run(tmp_path: Path, name: str, *overrides: str):
    """The built-in job, 25 steps and no eval unless overridden; asserts it finished. (Its
    ``shards_committed == shards_expected`` holds whenever a job finishes, by the census and
    ledger checks: those guards are shown to fire in tests/test_ledger.py.)"""
    job = load_job(None, ["steps=25", "eval=null", *overrides])
    result = run_job(job, run_dir=tmp_path / name)
    assert result.summary["status"] == "finished", result.summary.get("error")
    assert result.summary["shards_committed"] == result.summary["shards_expected"] == job.steps * job.shards
    return result


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
