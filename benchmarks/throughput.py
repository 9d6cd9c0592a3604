"""Clean throughput and launch time: ringleader vs Ray Train ``TorchTrainer`` vs Ray Train +
torchft (``TorchftConfig``: a quorum each step) vs torchrun (plain DDP, the floor each
contender's per-step overhead is measured from).

Every run is a fresh process launched from here, so launch-to-first-step counts everything a
user waits for (interpreter, imports, ``ray.init`` where it applies, actors, rendezvous).
``ringleader`` and ``ray_train`` start a fresh local Ray each (cold); ``ringleader_attached``
is ``ringleader run --address`` to a Ray head already running (started before the run and
stopped after it: what a Tune trial, a resume or a second job meets).
Frameworks run interleaved (A B C A B C ...) so drift on a shared machine hits all alike.
Step time is wall over steps: the time from the first step's completion to the last's, over
the steps in between (``step_seconds``), the same for every framework. (Not the median interval
between completions: ringleader commits a run-ahead batch's steps within a millisecond of each
other, so that median measured the commit loop, not a step.) samples/s counts every step after
the first over the same span.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.ray_head import RayHead, start_head
from benchmarks.torchft_loop import torchft_refusal
from benchmarks.workloads import workload_job
from jobspec.durable import read_jsonl
from jobspec.job import JobConfig

FRAMEWORKS = ("ringleader", "ringleader_attached", "ray_train", "torchft", "torchrun")
RUN_TIMEOUT_S = 900
# How long a timed-out run gets to shut its Ray down after SIGTERM before it is killed.
_TERMINATE_GRACE_S = 30.0


class BenchmarkError(RuntimeError):
    """A framework's run failed; the message carries the end of its output."""


@dataclass(frozen=True)
class RunRow:
    framework: str
    workload: str
    first_step_s: float
    step_s: float
    samples_per_s: float
    wall_s: float
    eval_loss: float | None
    tokens_per_s: float = 0.0  # loss weight per second: tokens for a token-level loss, else samples


def _command_ringleader(job_file: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "ringleader", "run", str(job_file), "--run-dir", str(result), "--no-progress"]


def _command_attached(head: RayHead | None) -> Callable[[Path, Path], list[str]]:
    def command(job_file: Path, result: Path) -> list[str]:
        if head is None:
            raise ValueError("ringleader_attached needs a running Ray head")
        return [*_command_ringleader(job_file, result), "--address", head.gcs_address]

    return command


def _command_ray_train(job_file: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.raytrain_entry", "--job", str(job_file), "--result", str(result)]


def _command_torchft(job_file: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.torchft_entry", "--job", str(job_file), "--result", str(result)]


def model_file(framework: str, workdir: Path) -> Path:
    """Where ``run_once(framework, ..., workdir, keep_model=True)`` left the final parameters."""
    return workdir / ("run" if framework.startswith("ringleader") else "") / "model.pt"


def torchrun_command(job: JobConfig, *extra: str) -> Callable[[Path, Path], list[str]]:
    """The command (of the job file and the result path) that runs ``job`` under torchrun
    (``benchmarks/torchrun_entry.py``, one process per worker), with ``extra`` arguments to the
    entry (``--variant zero``)."""

    def command(job_file: Path, result: Path) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={job.scaling.workers}",
            "-m", "benchmarks.torchrun_entry", "--job", str(job_file), "--result", str(result), *extra,
        ]

    return command


def run_command(command: list[str], timeout_s: float, what: str, env: dict[str, str] | None = None) -> float:
    """Run ``command`` in a fresh process that starts its own Ray (never one the caller points
    at); returns its wall seconds. Raises BenchmarkError with the end of its output if it exits
    non-zero or runs past ``timeout_s`` (then it gets SIGTERM, which our entries turn into
    ``ray.shutdown()``, so no Ray is orphaned; SIGKILL after a grace period). ``env``: the
    environment (default: this one without ``RAY_ADDRESS``)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=_TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise BenchmarkError(f"{what} timed out after {timeout_s:.0f}s:\n{(stdout + stderr)[-3000:]}") from None
    if proc.returncode != 0:
        raise BenchmarkError(f"{what} exited {proc.returncode}:\n{(stdout + stderr)[-3000:]}")
    return time.time() - started


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished ringleader run directory's summary and events."""
    return json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "events.jsonl")


def run_ringleader(job: JobConfig, workdir: Path, timeout_s: float, what: str) -> tuple[Path, float]:
    """``ringleader run`` of ``job`` in a fresh process (``run_command``), its job file and run
    directory under ``workdir``; returns the run directory and the wall seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / "job.json"
    job_file.write_text(job.model_dump_json())
    run_dir = workdir / "run"
    return run_dir, run_command(_command_ringleader(job_file, run_dir), timeout_s, what)


def ringleader_result(run_dir: Path) -> dict[str, Any]:
    """A finished ringleader run's figures in the peers' result format: each committed step's
    end time and loss weight, and the final eval."""
    summary, events = read_run(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    return {"step_ends": [e["time"] for e in steps], "step_weights": [e["weight"] for e in steps], "eval": summary["eval"]}


def step_seconds(ends: list[float]) -> float:
    """Seconds per step from the completion times ``ends`` (two or more, ascending): the span
    from the first completion to the last over the steps it holds. Robust to completions that
    arrive in bursts (a run-ahead batch commits its steps together), unlike any statistic of the
    intervals between them."""
    if len(ends) < 2:
        raise ValueError(f"need at least 2 step completions to time, got {len(ends)}")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def run_once(
    framework: str, job: JobConfig, workdir: Path, head: RayHead | None = None, keep_model: bool = False
) -> RunRow:
    """Launch one framework on ``job`` in a fresh process and measure it; ``head``: the running
    Ray that ``ringleader_attached`` joins; ``keep_model``: the final parameters are saved at
    ``model_file(framework, workdir)`` (ringleader always saves them; the Ray Train and torchft
    runs when asked; not torchrun)."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / "job.json"
    job_file.write_text(job.model_dump_json())
    ours = framework.startswith("ringleader")
    result = workdir / ("run" if ours else "result.json")
    command = {
        "ringleader": _command_ringleader,
        "ringleader_attached": _command_attached(head),
        "ray_train": _command_ray_train,
        "torchft": _command_torchft,
        "torchrun": torchrun_command(job),
    }[framework](job_file, result)
    if keep_model and framework in ("ray_train", "torchft"):
        command += ["--model", str(model_file(framework, workdir))]
    # Each framework starts its own Ray, never one this process or the shell points at; the
    # attached run reaches the benchmark's head (its token under the head's HOME).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if framework == "ringleader_attached" and head is not None:
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # the head's token, not the shell's
            env.pop(key, None)
        env.update(HOME=head.env["HOME"], RAY_AUTH_MODE=head.env["RAY_AUTH_MODE"])
    launched = time.time()
    wall_s = run_command(command, RUN_TIMEOUT_S, framework, env)
    data = ringleader_result(result) if ours else json.loads(result.read_text())
    return timed_row(framework, job, data, launched, wall_s)


def timed_row(framework: str, job: JobConfig, data: dict[str, Any], launched: float, wall_s: float) -> RunRow:
    """The row of a run of ``job`` launched at ``launched`` (epoch seconds) that took ``wall_s``,
    from its result ``data`` (``step_ends``, ``step_weights``, ``eval``, optionally
    ``step_samples``; as ``ringleader_result`` or a peer's entry writes it). Raises
    BenchmarkError with fewer than 2 steps to time."""
    ends: list[float] = data["step_ends"]
    if len(ends) < 2:
        raise BenchmarkError(f"{framework}: need at least 2 steps to time, got {len(ends)}")
    weights: list[float] = data["step_weights"]
    return RunRow(
        framework=framework,
        workload=job.name,
        first_step_s=ends[0] - launched,
        step_s=step_seconds(ends),
        # Samples trained: torchft's steps leave out replicas not in the quorum.
        samples_per_s=sum(data.get("step_samples", [job.batch_size] * len(ends))[1:]) / (ends[-1] - ends[0]),
        wall_s=wall_s,
        eval_loss=data["eval"].get("loss"),
        tokens_per_s=sum(weights[1:]) / (ends[-1] - ends[0]),
    )


def run_benchmark(
    workloads: list[str], workers: int, steps: int, repeats: int, log: Callable[[str], None] = print
) -> list[RunRow]:
    rows: list[RunRow] = []
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as scratch:
        for repeat in range(repeats):
            for workload in workloads:
                job = workload_job(workload, workers, steps)
                for framework in FRAMEWORKS:
                    workdir = Path(scratch) / f"{repeat}-{workload}-{framework}"
                    row = _run_alone(framework, job, workdir)
                    log(
                        f"  [{repeat + 1}/{repeats}] {workload:7s} {framework:19s} first step "
                        f"{row.first_step_s:6.2f}s  step {row.step_s * 1e3:7.2f}ms  "
                        f"{row.samples_per_s:9.0f} samples/s {row.tokens_per_s:10.0f} tokens/s"
                    )
                    rows.append(row)
    return rows


def _run_alone(framework: str, job: JobConfig, workdir: Path) -> RunRow:
    """``run_once``; for the attached run, with a Ray head started for it and stopped after, so
    no idle cluster shares the machine with the other runs."""
    if framework != "ringleader_attached":
        return run_once(framework, job, workdir)
    with contextlib.contextmanager(start_head)(workdir / "head", num_cpus=os.cpu_count() or 2) as head:
        return run_once(framework, job, workdir, head)


def medians(rows: list[RunRow]) -> dict[str, dict[str, dict[str, float]]]:
    """``{workload: {framework: {first_step_s, step_s, samples_per_s, tokens_per_s, wall_s}}}``,
    medians."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for workload in dict.fromkeys(r.workload for r in rows):
        table[workload] = {}
        for framework in FRAMEWORKS:
            mine = [r for r in rows if r.workload == workload and r.framework == framework]
            table[workload][framework] = {
                key: statistics.median(getattr(r, key) for r in mine)
                for key in ("first_step_s", "step_s", "samples_per_s", "tokens_per_s", "wall_s")
            }
    return table


def format_table(table: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        f"{'workload':8s} {'framework':19s} {'first_step_s':>12s} {'step_ms':>9s} {'samples/s':>10s} "
        f"{'tokens/s':>10s} {'wall_s':>8s}"
    ]
    for workload, by_framework in table.items():
        for framework, m in by_framework.items():
            lines.append(
                f"{workload:8s} {framework:19s} {m['first_step_s']:12.2f} {m['step_s'] * 1e3:9.2f} "
                f"{m['samples_per_s']:10.0f} {m['tokens_per_s']:10.0f} {m['wall_s']:8.2f}"
            )
        ours = by_framework["ringleader"]
        lines.append(
            f"{workload:8s} ratios: samples/s ours/ray_train {ours['samples_per_s'] / by_framework['ray_train']['samples_per_s']:.2f}x"
            f", ours/torchrun {ours['samples_per_s'] / by_framework['torchrun']['samples_per_s']:.2f}x;"
            f" first step ours/ray_train {ours['first_step_s'] / by_framework['ray_train']['first_step_s']:.2f}x"
        )
        ddp = by_framework["torchrun"]["step_s"]
        lines.append(
            f"{workload:8s} samples/s ours/torchft {ours['samples_per_s'] / by_framework['torchft']['samples_per_s']:.2f}x;"
            " step time over plain DDP (torchrun): "
            + ", ".join(f"{name} {(by_framework[name]['step_s'] - ddp) * 1e3:+.2f} ms"
                        for name in ("ringleader", "ray_train", "torchft"))
        )
        lines.append(
            f"{workload:8s} launch to first step: cold {ours['first_step_s']:.2f}s, attached to a running Ray "
            f"{by_framework['ringleader_attached']['first_step_s']:.2f}s, torchrun {by_framework['torchrun']['first_step_s']:.2f}s"
        )
    return "\n".join(lines)


def run_and_report(
    run: Callable[[], dict[str, Any]], format_result: Callable[[dict[str, Any]], str], json_path: str | None
) -> int:
    """A bench command's end: ``run()``, its result printed with ``format_result`` and written as
    JSON to ``json_path`` when given; 0. A BenchmarkError is printed instead, and 1 returned."""
    try:
        result = run()
    except BenchmarkError as err:
        print(f"ringleader: benchmark failed: {err}", file=sys.stderr)
        return 1
    print(format_result(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return 0


def main(workloads: list[str], workers: int, steps: int, repeats: int, json_path: str | None) -> int:
    if (refusal := torchft_refusal(*(workload_job(w, workers, steps) for w in workloads))) is not None:
        print(f"ringleader: {refusal}", file=sys.stderr)
        return 2
    print(f"throughput: {workloads} x {FRAMEWORKS}, {workers} workers, {steps} steps, {repeats} repeats")
    rows = run_benchmark(workloads, workers, steps, repeats)
    table = medians(rows)
    print(format_table(table))
    if json_path:
        # One workload: exactly {framework: {...}}; several: keyed by workload.
        payload: dict[str, Any] = table[workloads[0]] if len(workloads) == 1 else table
        Path(json_path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {json_path}")
    return 0


__all__ = [
    "BenchmarkError", "FRAMEWORKS", "RunRow", "asdict", "main", "medians", "ringleader_result", "run_and_report", "run_once", "step_seconds",
    "timed_row", "torchrun_command",
]
