"""Straggler benchmark: one of four workers computes ``factor`` times slower.

In one run, interleaved and repeated: (a) ringleader with no slowness, (b) slowness with
mitigation off, (c) slowness with mitigation on, (d) Ray Train ``TorchTrainer`` (DDP) with the
same slowness injected the same way (``workers/chaos.py``), and (e) no slowness with mitigation
off, which prices the mitigation when nothing is slow (a / e). The ideal for (c) is (a) scaled
by the workers' summed speed: a x (n - 1 + 1/factor) / n.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from benchmarks.throughput import run_once
from benchmarks.workloads import workload_job
from orchestrator.config import JobConfig

VARIANTS = ("clean", "unmitigated", "mitigated", "ray_train", "clean_unmitigated")


def variant_job(base: JobConfig, variant: str, factor: float) -> tuple[str, JobConfig]:
    """(framework, job) for one variant; the last worker is the slow one."""
    slow = [{"worker": base.scaling.workers - 1, "factor": factor}] if variant in ("unmitigated", "mitigated", "ray_train") else []
    mitigation = variant in ("clean", "mitigated")
    # Fit all workers on this machine: a CPU share each, at most one.
    cpus = min(1.0, (os.cpu_count() or 1) / base.scaling.workers)
    job = JobConfig.model_validate(
        {
            **base.model_dump(),
            "scaling": {**base.scaling.model_dump(), "resources_per_worker": {"CPU": cpus}},
            "chaos": {"slow": slow},
            "stragglers": {**base.stragglers.model_dump(), "mitigation": mitigation},
        }
    )
    return ("ray_train" if variant == "ray_train" else "ringleader"), job


def run_benchmark(
    workload: str, workers: int, steps: int, factor: float, repeats: int, log: Callable[[str], None] = print
) -> dict[str, list[float]]:
    """samples/s of every variant in every repeat."""
    base = workload_job(workload, workers, steps)
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rl-straggler-") as scratch:
        for repeat in range(repeats):
            for variant in VARIANTS:
                framework, job = variant_job(base, variant, factor)
                row = run_once(framework, job, Path(scratch) / f"{repeat}-{variant}")
                rates[variant].append(row.samples_per_s)
                log(f"  [{repeat + 1}/{repeats}] {variant:18s} {row.samples_per_s:9.0f} samples/s")
    return rates


def summarize(rates: dict[str, list[float]], workers: int, factor: float) -> dict[str, object]:
    medians = {v: statistics.median(r) for v, r in rates.items()}
    ideal = medians["clean"] * (workers - 1 + 1 / factor) / workers
    return {
        "samples_per_s": {k: medians[k] for k in ("clean", "unmitigated", "mitigated", "ray_train")},
        "ideal": ideal,
        "clean_unmitigated": medians["clean_unmitigated"],
        "ratios": {
            "mitigated/ideal": medians["mitigated"] / ideal,
            "mitigated/unmitigated": medians["mitigated"] / medians["unmitigated"],
            "mitigated/ray_train": medians["mitigated"] / medians["ray_train"],
            "clean/clean_unmitigated": medians["clean"] / medians["clean_unmitigated"],
        },
    }


def main(workload: str, workers: int, steps: int, factor: float, repeats: int, json_path: str | None) -> int:
    print(f"straggler: {workload}, {workers} workers, worker {workers - 1} {factor:g}x slower, {steps} steps, {repeats} repeats")
    result = summarize(run_benchmark(workload, workers, steps, factor, repeats), workers, factor)
    print(f"{'variant':18s} {'samples/s':>10s}")
    for name, value in result["samples_per_s"].items():  # type: ignore[union-attr]
        print(f"{name:18s} {value:10.0f}")
    print(f"{'ideal':18s} {result['ideal']:10.0f}")
    print(f"{'clean_unmitigated':18s} {result['clean_unmitigated']:10.0f}")
    print("  ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))  # type: ignore[union-attr]
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return 0
