"""The benchmark workloads: the shipped example jobs, sized for measuring throughput."""

from __future__ import annotations

from pathlib import Path

from jobspec.job import JobConfig
from orchestrator.job_file import load_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# digits with a wide MLP (64 -> 1024 -> 1024 -> 1024 -> 10, 2.18M parameters): enough gradient
# bytes per step that communication matters, as in the Ray Train comparison this started from.
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "digits": ("digits.yaml", ["model.kwargs={hidden: 1024, depth: 3}"]),
    "tinylm": ("tinylm.yaml", []),
    # The LM recipe (AdamW, warmup-cosine, clipping, bf16, causal_lm): the peers run it too.
    "gpt": ("gpt.yaml", ["checkpoint.every_steps=0"]),
}


def workload_job(name: str, workers: int, steps: int) -> JobConfig:
    """The job for workload ``name`` on ``workers`` workers of one CPU each, for ``steps`` steps."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    file, overrides = WORKLOADS[name]
    return load_job(
        EXAMPLES / file,
        [
            *overrides,
            f"steps={steps}",
            f"scaling={{workers: {workers}, min_workers: 1, max_workers: {workers}, "
            "resources_per_worker: {CPU: 1}}",
        ],
    )
