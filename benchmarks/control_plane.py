"""``ringleader bench control-plane``: what the driver and the claim store cost per step as the
worker count grows, on real Ray actors with a null model (``benchmarks/null_model.py``).

Each worker count runs as its own job in a fresh process (its own Ray), with the defaults a user
gets (mitigation on: claims in the store every step). The job's ``summary.json`` holds its
``control_plane`` medians (``orchestrator/output/control_meter.py``): driver CPU and busy time per
step, step wall time, store round trips and bytes per step. A least-squares line
``cost = fixed + per_worker x N`` through them predicts the cost at any N; the issue's bar is
the driver's cost at 4096 workers as a share of a 1 s step.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.throughput import BenchmarkError, read_run, run_ringleader
from jobspec.job import JobConfig

DEFAULT_WORKERS = (4, 8, 16, 32, 64)
#: Measured columns of ``summary["control_plane"]`` fitted against N.
FITTED = ("driver_cpu_ms", "driver_busy_ms", "store_round_trips", "store_bytes")
#: The worker count and step time the fit is judged at (the issue's bar: <= 2% of a 1 s step).
PREDICT_AT = 4096
REFERENCE_STEP_MS = 1000.0


def control_plane_job(workers: int, steps: int, claim_stores: int | None = None) -> JobConfig:
    """The null job on ``workers`` workers: one shard per worker, one sample per shard, defaults
    for everything the control plane does (mitigation, telemetry, events); its claims over
    ``claim_stores`` store processes (None: the default)."""
    return JobConfig.model_validate({
        "name": f"control-plane-{workers}",
        "model": {"factory": "benchmarks.null_model:make_model"},
        "dataset": {"factory": "benchmarks.null_model:make_dataset"},
        "loss": "mse",
        "optimizer": {"name": "sgd", "kwargs": {"lr": 0.0}},
        "batch_size": workers,
        "shards": workers,
        "steps": steps,
        "eval": None,
        "scaling": {"workers": workers, "resources_per_worker": {"CPU": 0.01}},
        "timeouts": {"start_s": 60.0 + 5.0 * workers},
        "stragglers": {"claim_stores": claim_stores},
    })


def measure(workers: int, steps: int, scratch: Path, claim_stores: int | None = None) -> dict[str, Any]:
    """Run the null job on ``workers`` workers (claims over ``claim_stores`` stores); its
    summary's ``control_plane`` plus ``workers``. Raises BenchmarkError if the run fails or
    measured nothing."""
    run_dir, _ = run_ringleader(
        control_plane_job(workers, steps, claim_stores), scratch / f"n{workers}", 300.0 + 10.0 * workers + 2.0 * steps,
        f"control-plane job with {workers} workers",
    )
    summary, _ = read_run(run_dir)
    measured = summary.get("control_plane") or {}
    if not measured:
        raise BenchmarkError(f"the job with {workers} workers measured no step ({steps} steps): raise --steps")
    return {"workers": workers, **measured}


def idle_driver_cpu_ms_per_s(seconds: float = 10.0) -> float:
    """The CPU a Ray driver process spends per second doing nothing (Ray's own threads: the
    core worker's heartbeats, subscriptions, metrics export), measured here with a local Ray
    started in this process for ``seconds``. On this machine the step's wall time grows with
    the worker count (2 cores time-shared by N actors), so this per-second cost would otherwise
    pass for a per-worker one in the fit."""
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(2.0)  # past the start's own work
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return 1000.0 * (time.process_time() - cpu) / (time.perf_counter() - wall)
    finally:
        ray.shutdown()


def with_idle_taken_out(rows: list[dict[str, Any]], idle_ms_per_s: float) -> None:
    """Add ``driver_cpu_net_ms`` to each row: its driver CPU less the idle driver's over the
    step's wall time (what the step's work itself cost the driver)."""
    for row in rows:
        row["driver_cpu_net_ms"] = row["driver_cpu_ms"] - idle_ms_per_s * row["step_wall_ms"] / 1000.0


def line_fit(workers: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares ``(fixed, per_worker)`` of ``values ~ fixed + per_worker x workers``."""
    per_worker, fixed = np.polyfit(np.array(workers, dtype=float), np.array(values, dtype=float), 1)
    return float(fixed), float(per_worker)


def fit(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Least-squares ``fixed + per_worker x N`` for each column of ``FITTED`` (and the store
    process's CPU, ``store_cpu_ms``, when every row has it), and its prediction at
    ``PREDICT_AT`` workers. Needs two worker counts or more."""
    if len({r["workers"] for r in rows}) < 2:
        raise ValueError("fitting needs at least two worker counts")
    workers = [r["workers"] for r in rows]
    out = {}
    optional = tuple(c for c in ("driver_cpu_net_ms", "store_cpu_ms") if all(c in r for r in rows))
    for column in FITTED + optional:
        fixed, per_worker = line_fit(workers, [r[column] for r in rows])
        out[column] = {"fixed": fixed, "per_worker": per_worker, "at_4096": fixed + per_worker * PREDICT_AT}
    return out


def format_report(rows: list[dict[str, Any]], fitted: dict[str, dict[str, float]], idle_ms_per_s: float | None = None) -> str:
    lines = [
        f"{'workers':>7} {'cpu_ms':>8} {'busy_ms':>8} {'wall_ms':>8} {'trips':>7} {'bytes':>9} {'store_cpu_ms':>12} {'per_call':>8}"
        "  (per step: medians; the store process's CPU and steps per call means)"
    ]
    for r in rows:
        store_cpu = f"{r['store_cpu_ms']:>12.2f}" if "store_cpu_ms" in r else f"{'-':>12}"
        lines.append(
            f"{r['workers']:>7} {r['driver_cpu_ms']:>8.2f} {r['driver_busy_ms']:>8.2f} {r['step_wall_ms']:>8.2f} "
            f"{r['store_round_trips']:>7.0f} {r['store_bytes']:>9.0f} {store_cpu} {r.get('steps_per_call', 1):>8.1f}"
        )
    lines.append("fit: cost = fixed + per_worker x N")
    for column, f in fitted.items():
        lines.append(f"  {column:<18} fixed {f['fixed']:>10.3f}  per_worker {f['per_worker']:>9.4f}  at {PREDICT_AT}: {f['at_4096']:>12.1f}")
    driver = max(fitted["driver_cpu_ms"]["at_4096"], fitted["driver_busy_ms"]["at_4096"])
    lines.append(
        f"driver at {PREDICT_AT} workers: {driver:.1f} ms per step = {100 * driver / REFERENCE_STEP_MS:.1f}% "
        f"of a {REFERENCE_STEP_MS / 1000:.0f} s step (target <= 2%)"
    )
    if idle_ms_per_s is not None and "driver_cpu_net_ms" in fitted:
        net = fitted["driver_cpu_net_ms"]["at_4096"] + idle_ms_per_s * REFERENCE_STEP_MS / 1000.0
        lines.append(
            f"idle Ray driver: {idle_ms_per_s:.2f} ms CPU per s of wall; the step's own driver CPU "
            f"(driver_cpu_net_ms) fitted, plus the idle driver over a {REFERENCE_STEP_MS / 1000:.0f} s step: "
            f"{net:.1f} ms CPU at {PREDICT_AT} workers = {100 * net / REFERENCE_STEP_MS:.1f}% (target <= 2%)"
        )
    return "\n".join(lines)


def main(
    workers: list[int],
    steps: int,
    json_path: str | None,
    scratch: str | None = None,
    synthetic: list[int] | None = None,
    claim_stores: int | None = None,
) -> int:
    """Real jobs on ``workers`` actors (none: skipped; claims over ``claim_stores`` stores), then
    the controller on synthetic groups of ``synthetic`` ranks (``benchmarks/driver_scale.py``);
    prints the rows and fits."""
    out: dict[str, Any] = {}
    if synthetic:
        from benchmarks.driver_scale import main_synthetic
        from orchestrator.output.metrics import WORKER_GAUGES_EVERY_S

        rows = main_synthetic(control_plane_job, synthetic, steps)
        out["synthetic"] = rows
        if len(rows) > 1:
            # The per-worker gauges' pass, every WORKER_GAUGES_EVERY_S, charged to a 1 s step.
            cost = [r["driver_cpu_ms"] + r["worker_gauges_ms"] / WORKER_GAUGES_EVERY_S for r in rows]
            fixed, per_worker = line_fit([r["workers"] for r in rows], cost)
            out["synthetic_fit"] = {"fixed": fixed, "per_worker": per_worker}
            print(
                f"synthetic fit (gauges included at 1 s steps): driver CPU = {fixed:.2f} + {1000 * per_worker:.2f} us x N ms per step: "
                f"{fixed + per_worker * 4096:.1f} ms at 4096 (target <= 20), {fixed + per_worker * 16384:.1f} ms at 16,384 "
                "(target <= 80)"
            )
    if not workers:
        if json_path:
            Path(json_path).write_text(json.dumps(out, indent=2))
        return 0
    idle = idle_driver_cpu_ms_per_s()
    print(f"control-plane: an idle Ray driver spends {idle:.2f} ms CPU per second", flush=True)
    with tempfile.TemporaryDirectory(prefix="control-plane-", dir=scratch) as tmp:
        rows = []
        for count in workers:
            print(f"control-plane: {count} workers, {steps} steps", flush=True)
            rows.append(measure(count, steps, Path(tmp), claim_stores))
    with_idle_taken_out(rows, idle)
    fitted = fit(rows) if len(rows) > 1 else {}
    print(format_report(rows, fitted, idle) if fitted else json.dumps(rows, indent=2))
    if json_path:
        out.update(rows=rows, fit=fitted, idle_driver_cpu_ms_per_s=idle)
        Path(json_path).write_text(json.dumps(out, indent=2))
        print(f"wrote {json_path}")
    return 0
