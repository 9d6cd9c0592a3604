"""``ringleader bench recovery``: one worker SIGKILLed at the same step of the same job, ours vs
Ray Train (``TorchTrainer`` + ``FailureConfig``, checkpoints every N steps), in one run; and what
asynchronous checkpoints every N steps cost our throughput.

Numbers, per framework: ``recovery_s`` from the kill (the victim's own clock, just before it
kills itself) to the next completed step; ``steps_lost``, steps that had been committed before
the kill and were computed again; ``wall_s``, the whole run from launch. Both runs start their
own local Ray in a fresh process. ``checkpoint_overhead`` is 1 - (samples/s with checkpoints
every N steps) / (samples/s without), over alternating runs (medians).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Callable

from benchmarks.recovery_baseline import run_command, run_ray_train_recovery
from benchmarks.throughput import BenchmarkError, read_run
from benchmarks.workloads import workload_job
from orchestrator.config import JobConfig

RUN_TIMEOUT_S = 900.0


def _with(job: JobConfig, **updates: Any) -> JobConfig:
    """``job`` with top-level sections replaced (validated again)."""
    return JobConfig.model_validate({**job.model_dump(mode="json"), **updates})


def _run_ours(job: JobConfig, workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / "job.json"
    job_file.write_text(job.model_dump_json())
    run_dir = workdir / "run"
    command = [sys.executable, "-m", "orchestrator.cli", "run", str(job_file), "--run-dir", str(run_dir), "--no-progress"]
    wall_s = run_command(command, RUN_TIMEOUT_S, "ringleader run")
    summary, events = read_run(run_dir)
    if summary["status"] != "finished":
        raise BenchmarkError(f"ringleader run {summary['status']}: {summary.get('error')}")
    return summary, events, wall_s


def ours_recovery(job: JobConfig, workdir: Path, kill_step: int, kill_rank: int, checkpoint_every: int) -> dict[str, Any]:
    """Our run of ``job`` with worker ``kill_rank`` SIGKILLed in step ``kill_step``."""
    chaos = {**job.chaos.model_dump(mode="json"), "kill": [{"at_step": kill_step, "worker": kill_rank, "how": "sigkill"}]}
    checkpoint = {**job.checkpoint.model_dump(mode="json"), "every_steps": checkpoint_every}
    summary, events, wall_s = _run_ours(_with(job, chaos=chaos, checkpoint=checkpoint), workdir)
    recovered = [e for e in events if e["event"] == "recovered"]
    if len(recovered) != 1:
        raise BenchmarkError(f"expected one recovery, the run had {len(recovered)}")
    recovery = recovered[0]
    died = next(e["time"] for e in events if e["event"] == "failure") - recovery["detect_s"]
    committed_before = sum(1 for e in events if e["event"] == "step" and e["time"] < died)
    return {
        "recovery_s": recovery["first_step_s"],
        "steps_lost": max(0, committed_before - min(recovery["redo_steps"], default=committed_before)),
        "wall_s": wall_s,
        "split_s": {k: recovery[k] for k in ("detect_s", "reform_s", "transfer_s", "redo_s")},
        "steps_redone": summary["events"]["steps_redone"],
        "final_loss": summary["final_loss"],
    }


def checkpoint_overhead(job: JobConfig, workdir: Path, every: int, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Samples/s of ``job`` without checkpoints and with one every ``every`` steps, alternating."""
    rates: dict[str, list[float]] = {"none": [], f"every_{every}": []}
    held: list[float] = []  # share of training time the snapshots held the steps up
    for repeat in range(repeats):
        for variant, steps in (("none", 0), (f"every_{every}", every)):
            checkpoint = {**job.checkpoint.model_dump(mode="json"), "every_steps": steps}
            summary, _, _ = _run_ours(_with(job, checkpoint=checkpoint), workdir / f"{variant}-{repeat}")
            rates[variant].append(summary["samples_per_s"])
            if steps:
                held.append(sum(summary["checkpoints"]["copy_s"]) / summary["train_s"])
            log(f"  [{repeat + 1}/{repeats}] checkpoints {variant:<10} {summary['samples_per_s']:8.0f} samples/s "
                f"({summary['checkpoints']['written']} written)")
    none, with_ = (statistics.median(r) for r in rates.values())
    return {
        "samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "overhead": 1 - with_ / none,
        "snapshot_share": statistics.median(held),
    }


def run_benchmark(
    workload: str, workers: int, steps: int, kill_step: int, checkpoint_every: int, repeats: int,
    overhead_steps: int, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    job = workload_job(workload, workers, steps)
    kill_rank = workers - 1
    with TemporaryDirectory(prefix="rl-recovery-") as scratch:
        root = Path(scratch)
        log(f"recovery: {workload}, {workers} workers, {steps} steps, worker {kill_rank} SIGKILLed in step {kill_step}")
        ours = ours_recovery(job, root / "ours", kill_step, kill_rank, checkpoint_every)
        log(f"  ours       recovery {ours['recovery_s']:7.2f}s  lost {ours['steps_lost']}  wall {ours['wall_s']:.1f}s")
        ray_train = run_ray_train_recovery(job, root / "ray_train", kill_step, kill_rank, checkpoint_every, RUN_TIMEOUT_S)
        log(f"  ray_train  recovery {ray_train['recovery_s']:7.2f}s  lost {ray_train['steps_lost']}  "
            f"wall {ray_train['wall_s']:.1f}s")
        log(f"checkpoint overhead: {overhead_steps} steps, every {checkpoint_every} vs none, {repeats} repeats")
        long_job = workload_job(workload, workers, overhead_steps)
        overhead = checkpoint_overhead(long_job, root / "overhead", checkpoint_every, repeats, log)
    return {
        "ours": ours,
        "ray_train": {k: ray_train[k] for k in ("recovery_s", "steps_lost", "wall_s", "resumed_from", "restart_s")},
        "checkpoint_overhead": overhead["overhead"],
        "checkpoint_samples_per_s": overhead["samples_per_s"],
        "checkpoint_snapshot_share": overhead["snapshot_share"],
        "setup": {"workload": workload, "workers": workers, "steps": steps, "kill_step": kill_step,
                  "kill_rank": kill_rank, "checkpoint_every": checkpoint_every, "repeats": repeats,
                  "overhead_steps": overhead_steps},
    }


def format_result(result: dict[str, Any]) -> str:
    ours, theirs = result["ours"], result["ray_train"]
    lines = [
        f"{'':10} {'recovery_s':>10} {'steps_lost':>10} {'wall_s':>8}",
        f"{'ours':10} {ours['recovery_s']:10.2f} {ours['steps_lost']:10d} {ours['wall_s']:8.1f}",
        f"{'ray_train':10} {theirs['recovery_s']:10.2f} {theirs['steps_lost']:10d} {theirs['wall_s']:8.1f}",
        f"recovery ray_train/ours {theirs['recovery_s'] / ours['recovery_s']:.1f}x; our split "
        + ", ".join(f"{k} {v:.3f}" for k, v in ours["split_s"].items()),
        f"checkpoint every {result['setup']['checkpoint_every']} steps: overhead {result['checkpoint_overhead']:+.1%} "
        f"({result['checkpoint_samples_per_s']}); snapshots held training up "
        f"{result['checkpoint_snapshot_share']:.2%} of its time",
    ]
    return "\n".join(lines)


def main(workload: str, workers: int, steps: int, kill_step: int, checkpoint_every: int, repeats: int,
         overhead_steps: int, json_path: str | None) -> int:
    if not 0 < kill_step < steps:
        print(f"ringleader: --kill-step must be in (0, {steps}), got {kill_step}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(workload, workers, steps, kill_step, checkpoint_every, repeats, overhead_steps)
    except BenchmarkError as err:
        print(f"ringleader: benchmark failed: {err}", file=sys.stderr)
        return 1
    print(format_result(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0
