"""``ringleader bench sharding``: sharded optimizer state (``sharding.group_size``) side by side
with today's replicated run and with PyTorch's own ways to shard, in one run.

For each workload (the shipped ``tinylm`` and the GPT recipe: AdamW, clipping, bf16) on
``workers`` workers:

1. **State per rank** at each group size, read from a real ``TrainWorker``'s tensors on spawned
   ranks (``benchmarks/sharding_memory.py``), against the plan's ``rank_bytes``; the optimizer's
   bytes over the unsharded run's (target: 1/g within 5%).
2. **Peak per rank** in a step (state + the step's peak above it, torch's profiler memory
   events), over the unsharded run's (target at g=4 on the GPT recipe: at most 0.6), and the
   plan's, also with gradients sharded (which ringleader does not do yet).
3. **Samples/s** of whole ``ringleader run``s on Ray at each group size (each a fresh process
   with its own Ray, as ``bench throughput`` launches them; interleaved over ``repeats``,
   medians), and of the same job under torchrun with DDP + ``ZeroRedundancyOptimizer`` (every
   repeat) and with FSDP2's ``fully_shard`` (one attempt, in the first; both in
   ``benchmarks/sharded_peers.py``; rank 0 of these also measures a step's peak, and their timed
   span starts after that step). A ratio is the median over repeats of the two contenders' runs
   in the same repeat (neighbours in time: this machine's speed drifts more between repeats
   than contenders differ). Targets: g>1 at least 0.95x of g=1, and at least 1.0x ZeRO + DDP.
   Our runs' step phases (compute, communication, optimizer: the workers' telemetry, medians)
   say where a difference comes from.
4. **Recovery with replicas** (``benchmarks/sharding_recovery.py``): g=2, and g=1 beside it,
   with one worker SIGKILLed mid-run, the group waiting for a new actor or the survivors going
   on (targets: recovery at most 0.2 s, nothing lost, final parameters exact).

Every job here has no eval (``eval: null``) and asks for ``min(1, CPUs / workers)`` CPUs a
worker, so ``workers`` ranks fit this machine's local Ray.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from benchmarks.ranks import RankError
from benchmarks.sharding_memory import format_memory, measure_memory, ratios
from benchmarks.sharding_recovery import measure_recoveries, recovery_lines, recovery_skipped, recovery_targets
from benchmarks.throughput import (
    RUN_TIMEOUT_S,
    BenchmarkError,
    RunRow,
    ringleader_result,
    run_and_report,
    run_command,
    run_once,
    timed_row,
    torchrun_command,
)
from benchmarks.workloads import sharded_job
from jobspec.job import JobConfig
from jobspec.step_record import read_telemetry

PEERS = ("zero", "fsdp2")
#: Peers tried in the first repeat only (a quick attempt, not a timing series).
ONCE = ("fsdp2",)
#: The step rank 0 of a peer measures (after two that create the state and warm up); the
#: peers' samples/s are timed from its end.
PEER_PEAK_STEP = 2
#: The step phases a worker's telemetry times (``telemetry.jsonl``), shown for our runs.
PHASES = ("compute_s", "comm_s", "optim_s")

#: Runs ``job`` with ringleader in ``workdir`` (its run directory ``workdir / "run"``) and times it.
OursRunner = Callable[[JobConfig, Path], RunRow]


def ours_fresh(job: JobConfig, workdir: Path) -> RunRow:
    """``ringleader run`` in a fresh process with its own Ray (``bench throughput``'s launch)."""
    return run_once("ringleader", job, workdir)


def ours_in_process(job: JobConfig, workdir: Path) -> RunRow:
    """The job run in this process on the Ray it already initialised (the tests' cluster);
    launch times then leave out Ray's start, samples/s does not depend on them."""
    from orchestrator.launch import run_job

    launched = time.time()
    result = run_job(job, run_dir=workdir / "run")
    if result.summary["status"] != "finished":
        raise BenchmarkError(f"ringleader run {result.summary['status']}: {result.summary.get('error')}")
    return timed_row("ringleader", job, ringleader_result(workdir / "run"), launched, time.time() - launched)


def run_peer(variant: str, job: JobConfig, workdir: Path) -> tuple[RunRow, dict[str, Any]]:
    """Peer ``variant`` (``zero``, ``fsdp2``) on ``job`` under torchrun: its row and rank 0's
    measured step (``StepPeak.as_dict``). Raises BenchmarkError with its output if it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result = workdir / "job.json", workdir / "result.json"
    job_file.write_text(job.model_dump_json())
    command = torchrun_command(job, "--variant", variant, "--peak-step", str(PEER_PEAK_STEP))(job_file, result)
    launched = time.time()
    wall_s = run_command(command, RUN_TIMEOUT_S, variant)
    data = json.loads(result.read_text())
    return timed_row(variant, job, data, launched, wall_s), data["memory"]


def _first_line_of_failure(err: Exception) -> str:
    """The last line of a failed run's output that names an error (its traceback's last)."""
    lines = [line.strip() for line in str(err).splitlines() if "Error" in line or "error" in line]
    return lines[-1] if lines else str(err).splitlines()[0]


def measure_throughput(
    workloads: list[str], group_sizes: list[int], workers: int, steps: int, repeats: int, scratch: Path,
    ours: OursRunner, peers: tuple[str, ...], log: Callable[[str], None],
) -> dict[str, Any]:
    """Interleaved runs (each repeat: every group size of ours, then each peer, per workload;
    those in ``ONCE`` in the first repeat only): ``{"rows": [RunRow as a dict, named "g=G" or
    the peer, with its "repeat"], "peer_memory": {workload: {peer: [measured step]}}, "failed":
    {peer: why}}``. A peer that fails is tried no more (its reason kept); ours failing raises."""
    rows: list[dict[str, Any]] = []
    peer_memory: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    failed: dict[str, str] = {}

    def keep(row: RunRow, name: str, workload: str, repeat: int, phases: dict[str, float] | None = None) -> None:
        rows.append({**asdict(row), "framework": name, "workload": workload, "repeat": repeat, "phases": phases})
        log(f"  [{repeat + 1}/{repeats}] {workload:7s} {name:6s} {row.samples_per_s:8.1f} samples/s")

    for repeat in range(repeats):
        for workload in workloads:
            for g in group_sizes:
                workdir = scratch / f"{repeat}-{workload}-g{g}"
                row = ours(sharded_job(workload, workers, steps, g), workdir)
                keep(row, f"g={g}", workload, repeat, step_phases(workdir / "run"))
            for peer in (p for p in peers if p not in failed and (repeat == 0 or p not in ONCE)):
                try:
                    row, memory = run_peer(peer, sharded_job(workload, workers, steps, 1), scratch / f"{repeat}-{workload}-{peer}")
                except BenchmarkError as err:
                    failed[peer] = _first_line_of_failure(err)
                    log(f"  [{repeat + 1}/{repeats}] {workload:7s} {peer} failed: {failed[peer]}")
                    continue
                keep(row, peer, workload, repeat)
                peer_memory[workload].setdefault(peer, []).append(memory)
    return {"rows": rows, "peer_memory": peer_memory, "failed": failed}


def step_phases(run_dir: Path) -> dict[str, float]:
    """Median seconds of each of ``PHASES`` over every rank's steps after the first (the
    run's ``telemetry.jsonl``)."""
    records = [r for r in read_telemetry(run_dir / "telemetry.jsonl") if r.get("step", 0) > 0]
    return {phase: statistics.median(r[phase] for r in records if phase in r) for phase in PHASES}


def phase_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Our runs' step phases in ms, the median over repeats of each run's medians, by workload and g."""
    found: dict[tuple[str, str], list[dict[str, float]]] = {}
    for row in rows:
        if row.get("phases"):
            found.setdefault((row["workload"], row["framework"]), []).append(row["phases"])
    return [
        f"{workload:8s} {name:4s} step phases, ms: "
        + ", ".join(f"{p.removesuffix('_s')} {statistics.median(r[p] for r in runs) * 1e3:6.2f}" for p in PHASES)
        for (workload, name), runs in found.items()
    ]


def samples_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{workload: {contender: median samples/s}}`` over the runs in ``rows``."""
    runs: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        runs.setdefault(row["workload"], {}).setdefault(row["framework"], []).append(row["samples_per_s"])
    return {workload: {name: statistics.median(rates) for name, rates in by_name.items()} for workload, by_name in runs.items()}


def paired_ratio(rows: list[dict[str, Any]], workload: str, a: str, b: str) -> float | None:
    """The median over repeats of contender ``a``'s samples/s over ``b``'s in the same repeat
    (None where no repeat has both)."""
    rate = {(r["repeat"], r["framework"]): r["samples_per_s"] for r in rows if r["workload"] == workload}
    found = [rate[n, a] / rate[n, b] for n in sorted({n for n, _ in rate}) if (n, a) in rate and (n, b) in rate]
    return statistics.median(found) if found else None


def run_benchmark(
    workloads: list[str], group_sizes: list[int], workers: int, steps: int, repeats: int,
    ours: OursRunner = ours_fresh, peers: tuple[str, ...] = PEERS, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every part of the bench (module docstring); recovery needs g=2 with a replica (``workers``
    at least 4), else it is skipped with the reason. Raises BenchmarkError if a run of ours or a
    measuring rank fails."""
    log(f"sharding: {workloads}, group sizes {group_sizes}, {workers} workers, {steps} steps, {repeats} repeats")
    jobs = {w: {g: sharded_job(w, workers, steps, g) for g in group_sizes} for w in workloads}
    log("memory: real TrainWorkers on spawned ranks over gloo")
    try:
        memory = measure_memory(jobs, workers)
    except RankError as err:
        raise BenchmarkError(f"measuring memory: {err}") from None
    result: dict[str, Any] = {"setup": {"workloads": workloads, "group_sizes": group_sizes, "workers": workers,
                                        "steps": steps, "repeats": repeats}, "memory": memory}
    with tempfile.TemporaryDirectory(prefix="rl-sharding-") as scratch:
        log("samples/s: ringleader on Ray, then the peers under torchrun")
        throughput = measure_throughput(workloads, group_sizes, workers, steps, repeats, Path(scratch), ours, peers, log)
        result.update(throughput, samples_per_s=samples_medians(throughput["rows"]), recovery={})
        if (why := recovery_skipped(group_sizes, workers)) is not None:
            result["recovery"] = {"skipped": why}
            return result
        clean = lambda workload, g: Path(scratch) / f"0-{workload}-g{g}"  # noqa: E731 - repeat 0's run
        result["recovery"] = measure_recoveries(workloads, group_sizes, workers, steps, clean, Path(scratch), log)
    return result


def _ratio_text(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio else "-"


def format_result(result: dict[str, Any]) -> str:
    """The bench's tables and its targets, each marked ok or MISS."""
    sizes = [f"g={g}" for g in result["setup"]["group_sizes"]]
    names = [*sizes, *PEERS]
    lines = [
        format_memory(result["memory"]),
        "samples/s (medians; ours on Ray, peers under torchrun; ratios: medians of same-repeat ratios):",
        f"{'workload':8s} " + " ".join(f"{n:>8s}" for n in names) + "  ratios",
    ]
    targets: list[str] = []
    for workload, by_name in result["samples_per_s"].items():
        cells = " ".join(f"{by_name[n]:8.1f}" if by_name.get(n) else f"{'-':>8s}" for n in names)
        pairs = [(s, "g=1", 0.95) for s in sizes if s != "g=1"] + [(s, "zero", 1.0) for s in sizes]
        found = {(a, b): paired_ratio(result["rows"], workload, a, b) for a, b, _ in pairs}
        lines.append(f"{workload:8s} {cells}  " + ", ".join(f"{a}/{b} {_ratio_text(found[a, b])}" for a, b, _ in pairs))
        targets += [
            _target(f"{workload} {a} samples/s >= {bound:.2f}x {'ZeRO+DDP' if b == 'zero' else b}", ratio, ratio >= bound)
            for a, b, bound in pairs if (ratio := found[a, b]) is not None
        ]
    lines += phase_lines(result["rows"])
    lines += _peer_lines(result)
    lines += recovery_lines(result["recovery"], result["setup"]["workers"])
    targets = _memory_targets(result["memory"]) + targets + recovery_targets(result["recovery"], _target)
    return "\n".join([*lines, "targets:", *(f"  {t}" for t in targets)])


def _target(what: str, value: float, ok: bool) -> str:
    """One target's line: ``ok`` or ``MISS``, what it asks, the value found."""
    return f"{'ok  ' if ok else 'MISS'} {what}: {value:.4g}"


def _memory_targets(memory: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    out: list[str] = []
    for workload, by_g in memory.items():
        if "1" not in by_g:
            continue
        scaled = ratios(by_g)
        for g, r in scaled.items():
            if g != "1":
                found = r["optimizer"] * int(g)
                out.append(_target(f"{workload} g={g} optimizer bytes / g=1's = 1/g within 5% (x g)", found, abs(found - 1) <= 0.05))
        if "4" in scaled and workload == "gpt":
            r = scaled["4"]
            transient = by_g["1"]["measured"]["transient"] / by_g["1"]["measured"]["peak"]
            out.append(_target("gpt g=4 peak / g=1's <= 0.6", r["peak"], r["peak"] <= 0.6)
                       + f" (plan {r['plan_peak']:.3f}; the state alone {r['state']:.3f}: the step's activations"
                       f" are {transient:.0%} of g=1's peak, and no sharding setting shrinks them)")
    return out


def _peer_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for peer, why in result["failed"].items():
        lines.append(f"{peer}: did not run: {why}")
    for workload, by_peer in result["peer_memory"].items():
        base = result["memory"][workload].get("1", {}).get("measured", {}).get("peak")
        for peer, steps in by_peer.items():
            step = steps[0]
            held = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in step["held"].items())
            lines.append(f"{workload:8s} {peer} rank 0: peak {step['peak'] / 1e6:.3f} MB ({_ratio_text(base and step['peak'] / base)} "
                         f"of ours at g=1), held MB: {held}"
                         + ("; DDP's gradient buckets not counted" if peer == "zero" else ""))
    return lines


def main(workloads: list[str], group_sizes: list[int], workers: int, steps: int, repeats: int, json_path: str | None) -> int:
    """The CLI's ``bench sharding``: 0 done, 1 a run failed, 2 bad input."""
    if steps < PEER_PEAK_STEP + 3 or repeats < 1 or min(group_sizes) < 1 or workers < max(group_sizes):
        print(f"ringleader: bench sharding needs --steps >= {PEER_PEAK_STEP + 3}, --repeats >= 1 and group sizes "
              f"between 1 and --workers ({workers}), got steps {steps}, repeats {repeats}, group sizes {group_sizes}",
              file=sys.stderr)
        return 2
    return run_and_report(lambda: run_benchmark(workloads, group_sizes, workers, steps, repeats), format_result, json_path)
