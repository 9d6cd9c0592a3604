"""The benchmark workloads: the shipped example jobs, sized for measuring throughput."""

from __future__ import annotations

import math
import os
from pathlib import Path

from jobspec.job import JobConfig
from orchestrator.job.reading import load_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# digits with a wide MLP (64 -> 1024 -> 1024 -> 1024 -> 10, 2.18M parameters): enough gradient
# bytes per step that communication matters, as in the Ray Train comparison this started from.
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "digits": ("digits.yaml", ["model.kwargs={hidden: 1024, depth: 3}"]),
    "tinylm": ("tinylm.yaml", []),
    # The LM recipe (AdamW, warmup-cosine, clipping, bf16, causal_lm): the peers run it too.
    "gpt": ("gpt.yaml", ["checkpoint.every_steps=0"]),
}


def workload_job(name: str, workers: int, steps: int, *overrides: str) -> JobConfig:
    """The job for workload ``name`` on ``workers`` workers of one CPU each, for ``steps`` steps,
    with further CLI-style ``overrides`` applied last."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    file, own = WORKLOADS[name]
    return load_job(
        EXAMPLES / file,
        [
            *own,
            f"steps={steps}",
            f"scaling={{workers: {workers}, min_workers: 1, max_workers: {workers}, "
            "resources_per_worker: {CPU: 1}}",
            *overrides,
        ],
    )


def sharded_job(name: str, workers: int, steps: int, group_size: int, *overrides: str) -> JobConfig:
    """``workload_job`` in sharding groups of ``group_size``, without eval, each worker asking
    for an equal share of this machine's CPUs (at most one, so ``workers`` fit a local Ray),
    with further ``overrides``."""
    cpus = min(1.0, math.floor((os.cpu_count() or 1) / workers * 100) / 100)
    return workload_job(
        name, workers, steps,
        "eval=null", f"sharding.group_size={group_size}", f"scaling.resources_per_worker={{CPU: {cpus:g}}}", *overrides,
    )
