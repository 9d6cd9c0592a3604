"""Straggler benchmark: one worker slowed, or random transient stalls on every worker.

A calibration run (ringleader, clean) first measures the clean step time and the compute
seconds per shard. ``--kind slow``: the last of the workers computes ``factor`` times slower
throughout: before each pass it sleeps (factor - 1) x that measured compute per shard, in both
frameworks alike (each measuring its own would not be alike: DDP's backward includes its
all-reduce). ``--kind stall``: each step of each worker stalls with ``probability`` for
``stall_steps`` x the clean step time, ``during`` its data fetch (which the mitigation can
rescue) or its compute (after it sealed its shards: nobody can take them over). The stalls are
drawn from a seed, the worker id and the step alone, so every variant and Ray Train see
exactly the same ones (``workers/runtime/chaos.py``).

In one run, interleaved and repeated: (a) ringleader clean, (b) the chaos with mitigation off,
(c) the chaos with mitigation on, (d) Ray Train ``TorchTrainer`` (DDP) and (d') Ray Train +
torchft (``benchmarks/torchft_loop.py``) with the same chaos injected the same way, and (e)
clean with mitigation off, which prices the mitigation when
nothing is slow (a / e). For ``slow`` the ideal for (c) is (a) scaled by the workers' summed
speed, a x (n - 1 + 1/factor) / n; for ``stall`` it is (a) (a stalled worker uses no CPU, so
on this machine the others can absorb its work), and ``hidden`` is the share of the time the
stalls cost without mitigation that the mitigation won back, in seconds per sample:
(1/b - 1/c) / (1/b - 1/a).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.throughput import RunRow, run_once
from benchmarks.torchft_loop import torchft_refusal
from benchmarks.workloads import workload_job
from jobspec.job import JobConfig
from jobspec.step_record import read_telemetry

VARIANTS = ("clean", "unmitigated", "mitigated", "ray_train", "torchft", "clean_unmitigated")
#: Variants that are a peer framework, not ringleader: they run the chaos, never our mitigation.
PEERS = ("ray_train", "torchft")


@dataclass(frozen=True)
class StragglerChaos:
    """What goes wrong: ``kind`` ``slow`` (the last worker ``factor`` x slower) or ``stall``
    (each worker-step stalls with ``probability`` for ``stall_steps`` clean steps, ``during``
    its fetch or compute, drawn from ``seed``)."""

    kind: str = "slow"
    factor: float = 3.0
    probability: float = 0.02
    stall_steps: float = 20.0
    during: str = "fetch"
    seed: int = 0

    def entries(self, workers: int, step_s: float, shard_s: float) -> dict[str, Any]:
        """The job's ``chaos`` section, given the clean step time ``step_s`` and compute per
        shard ``shard_s`` (seconds)."""
        if self.kind == "slow":
            return {"slow": [{"worker": workers - 1, "factor": self.factor, "shard_s": shard_s}]}
        if self.kind == "stall":
            seconds = self.stall_steps * step_s
            return {"stalls": {"probability": self.probability, "seconds": seconds, "seed": self.seed, "during": self.during}}
        raise ValueError(f"unknown straggler kind {self.kind!r}; expected 'slow' or 'stall'")

    def describe(self, workers: int) -> str:
        if self.kind == "slow":
            return f"worker {workers - 1} {self.factor:g}x slower"
        return (f"each worker-step stalls with p={self.probability:g} for {self.stall_steps:g} clean steps "
                f"during its {self.during} (seed {self.seed})")


def variant_job(base: JobConfig, variant: str, chaos: dict[str, Any]) -> tuple[str, JobConfig]:
    """(framework, job) for one variant, ``chaos`` injected where the variant has it."""
    mitigation = variant in ("clean", "mitigated")
    # Fit all workers on this machine: a CPU share each, at most one.
    cpus = min(1.0, (os.cpu_count() or 1) / base.scaling.workers)
    job = JobConfig.model_validate(
        {
            **base.model_dump(),
            "scaling": {**base.scaling.model_dump(), "resources_per_worker": {"CPU": cpus}},
            "chaos": chaos if variant in ("unmitigated", "mitigated", *PEERS) else {},
            "stragglers": {**base.stragglers.model_dump(), "mitigation": mitigation},
        }
    )
    return (variant if variant in PEERS else "ringleader"), job


def calibrate(base: JobConfig, workdir: Path) -> tuple[float, float]:
    """(median step seconds, median compute seconds per shard) of a clean ringleader run."""
    framework, job = variant_job(base, "clean", {})
    row = run_once(framework, job, workdir)
    telemetry = read_telemetry(workdir / "run" / "telemetry.jsonl")
    measured = [r for r in telemetry if r["shards_run"]]
    warm = [r["shard_s"] for r in measured if r["step"] >= 3] or [r["shard_s"] for r in measured]
    return row.step_s, statistics.median(warm)


def run_benchmark(
    workload: str, workers: int, steps: int, chaos: StragglerChaos, repeats: int, log: Callable[[str], None] = print
) -> tuple[float, dict[str, list[float]], dict[str, list[RunRow]]]:
    """(the clean step time the chaos was scaled by, samples/s of every variant in every repeat,
    and those runs' rows: their eval losses too, which the chaos, a matter of time, leaves as
    in a clean run)."""
    base = workload_job(workload, workers, steps)
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rows: dict[str, list[RunRow]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rl-straggler-") as scratch:
        step_s, shard_s = calibrate(base, Path(scratch) / "calibration")
        log(f"  calibration: clean step {step_s * 1000:.1f} ms, compute {shard_s * 1000:.2f} ms per shard")
        entries = chaos.entries(workers, step_s, shard_s)
        for repeat in range(repeats):
            for variant in VARIANTS:
                framework, job = variant_job(base, variant, entries)
                row = run_once(framework, job, Path(scratch) / f"{repeat}-{variant}")
                rates[variant].append(row.samples_per_s)
                rows[variant].append(row)
                log(f"  [{repeat + 1}/{repeats}] {variant:18s} {row.samples_per_s:9.0f} samples/s")
    return step_s, rates, rows


def summarize(rates: dict[str, list[float]], workers: int, chaos: StragglerChaos) -> dict[str, object]:
    medians = {v: statistics.median(r) for v, r in rates.items()}
    clean, unmitigated, mitigated = medians["clean"], medians["unmitigated"], medians["mitigated"]
    ideal = clean * (workers - 1 + 1 / chaos.factor) / workers if chaos.kind == "slow" else clean
    ratios = {
        "mitigated/clean": mitigated / clean,
        "mitigated/ideal": mitigated / ideal,
        "mitigated/unmitigated": mitigated / unmitigated,
        "mitigated/ray_train": mitigated / medians["ray_train"],
        "mitigated/torchft": mitigated / medians["torchft"],
        "clean/clean_unmitigated": clean / medians["clean_unmitigated"],
    }
    # The price of mitigation when nothing is slow, per repeat: its spread is the noise.
    per_repeat = [a / b for a, b in zip(rates["clean"], rates["clean_unmitigated"])]
    result: dict[str, object] = {
        "samples_per_s": {k: medians[k] for k in ("clean", "unmitigated", "mitigated", *PEERS)},
        "ideal": ideal,
        "clean_unmitigated": medians["clean_unmitigated"],
        "ratios": ratios,
        "clean/clean_unmitigated per repeat": per_repeat,
    }
    lost = 1 / unmitigated - 1 / clean  # seconds per sample the chaos cost without mitigation
    if chaos.kind == "stall" and lost > 0:
        result["hidden"] = (1 / unmitigated - 1 / mitigated) / lost
    return result


def main(
    workload: str, workers: int, steps: int, chaos: StragglerChaos, repeats: int, json_path: str | None
) -> int:
    if (refusal := torchft_refusal(workload_job(workload, workers, steps))) is not None:
        print(f"ringleader: {refusal}", file=sys.stderr)
        return 2
    print(f"straggler: {workload}, {workers} workers, {chaos.describe(workers)}, {steps} steps, {repeats} repeats")
    step_s, rates, _ = run_benchmark(workload, workers, steps, chaos, repeats)
    result = summarize(rates, workers, chaos)
    result["clean_step_s"] = step_s
    print(f"{'variant':18s} {'samples/s':>10s}")
    for name, value in result["samples_per_s"].items():  # type: ignore[union-attr]
        print(f"{name:18s} {value:10.0f}")
    print(f"{'ideal':18s} {result['ideal']:10.0f}")
    print(f"{'clean_unmitigated':18s} {result['clean_unmitigated']:10.0f}")
    print("  ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))  # type: ignore[union-attr]
    spread = result["clean/clean_unmitigated per repeat"]
    print(f"clean/clean_unmitigated per repeat: {' '.join(f'{r:.2f}' for r in spread)}")  # type: ignore[union-attr]
    if "hidden" in result:
        print(f"stall time hidden by mitigation: {result['hidden']:.0%}")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return 0
