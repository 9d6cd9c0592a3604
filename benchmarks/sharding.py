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
4. **Recovery with replicas**: g=2 with one worker SIGKILLed mid-run, twice: ``replaced``,
   with ``scaling.min_workers`` = ``workers`` (the group waits for a replacement actor, which
   takes the dead rank's slice from its replica), and ``survivors``, with ``min_workers`` 1
   (the survivors go on at once, the groups re-planned and the state resharded in memory; the
   replacement joins later): the ``recovered`` event's split, steps lost, samples dropped
   (``benchmarks/recovery.py``'s reading), and the final parameters against the clean g=2
   run's (targets: recovery at most 0.2 s, nothing lost, exact).

Every job here has no eval (``eval: null``) and asks for ``min(1, CPUs / workers)`` CPUs a
worker, so ``workers`` ranks fit this machine's local Ray.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from benchmarks.ranks import RankError
from benchmarks.recovery import ours_recovery, param_diff
from benchmarks.sharding_memory import format_memory, measure_memory, ratios
from benchmarks.throughput import (
    RUN_TIMEOUT_S, BenchmarkError, RunRow, model_file, ringleader_result, run_and_report, run_command, run_once,
    timed_row, torchrun_command,
)
from benchmarks.workloads import workload_job
from jobspec.job import JobConfig
from ringleader.api import as_job

PEERS = ("zero", "fsdp2")
#: Peers tried in the first repeat only (a quick attempt, not a timing series).
ONCE = ("fsdp2",)
#: The step rank 0 of a peer measures (after two that create the state and warm up); the
#: peers' samples/s are timed from its end.
PEER_PEAK_STEP = 2
#: The killed worker in the recovery run.
KILL_WORKER = 1

#: Runs ``job`` with ringleader in ``workdir`` (its run directory ``workdir / "run"``) and times it.
OursRunner = Callable[[JobConfig, Path], RunRow]


def sharded_job(workload: str, workers: int, steps: int, group_size: int, *overrides: str) -> JobConfig:
    """Workload ``workload`` on ``workers`` workers for ``steps`` steps in sharding groups of
    ``group_size``, without eval, each worker asking for a share of this machine's CPUs (at most
    one), with further CLI-style ``overrides``."""
    cpus = min(1.0, math.floor((os.cpu_count() or 1) / workers * 100) / 100)
    return as_job(
        workload_job(workload, workers, steps),
        ["eval=null", f"sharding.group_size={group_size}", f"scaling.resources_per_worker={{CPU: {cpus:g}}}", *overrides],
    )


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

    def keep(row: RunRow, name: str, workload: str, repeat: int) -> None:
        rows.append({**asdict(row), "framework": name, "workload": workload, "repeat": repeat})
        log(f"  [{repeat + 1}/{repeats}] {workload:7s} {name:6s} {row.samples_per_s:8.1f} samples/s")

    for repeat in range(repeats):
        for workload in workloads:
            for g in group_sizes:
                keep(ours(sharded_job(workload, workers, steps, g), scratch / f"{repeat}-{workload}-g{g}"), f"g={g}", workload, repeat)
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


def samples_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{workload: {contender: median samples/s}}`` over the runs in ``rows``."""
    runs: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        runs.setdefault(row["workload"], {}).setdefault(row["framework"], []).append(row["samples_per_s"])
    return {workload: {name: statistics.median(rates) for name, rates in by_name.items()} for workload, by_name in runs.items()}


#: The recovery runs: their name and ``scaling.min_workers`` (None: all the workers).
RECOVERY_VARIANTS: dict[str, int | None] = {"replaced": None, "survivors": 1}


def paired_ratio(rows: list[dict[str, Any]], workload: str, a: str, b: str) -> float | None:
    """The median over repeats of contender ``a``'s samples/s over ``b``'s in the same repeat
    (None where no repeat has both)."""
    rate = {(r["repeat"], r["framework"]): r["samples_per_s"] for r in rows if r["workload"] == workload}
    found = [rate[n, a] / rate[n, b] for n in sorted({n for n, _ in rate}) if (n, a) in rate and (n, b) in rate]
    return statistics.median(found) if found else None


def measure_recovery(
    workload: str, workers: int, steps: int, kill_step: int, min_workers: int, workdir: Path, clean: Path | None
) -> dict[str, Any]:
    """Our g=2 run of ``workload`` with worker ``KILL_WORKER`` SIGKILLed in ``kill_step``, with
    ``min_workers``: ``ours_recovery``'s figures, and with ``clean`` (the clean g=2 run's
    directory) the final parameters' largest difference and whether they are exact."""
    job = sharded_job(workload, workers, steps, 2, f"scaling.min_workers={min_workers}")
    figures = ours_recovery(job, workdir, kill_step, KILL_WORKER, 0)
    figures["precision"] = job.precision
    if clean is not None:
        figures["max_param_diff"], figures["exact"] = param_diff(workdir / "run" / "model.pt", model_file("ringleader", clean))
    return figures


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
        if workers < 4 or 2 not in group_sizes:
            result["recovery"] = {"skipped": f"needs g=2 among the group sizes and 4 workers or more (2 replicas), "
                                             f"got {group_sizes} and {workers}"}
            return result
        kill_step = steps // 2
        for workload in workloads:
            clean = Path(scratch) / f"0-{workload}-g2"
            for name, min_workers in RECOVERY_VARIANTS.items():
                log(f"recovery: {workload} g=2 {name}, worker {KILL_WORKER} SIGKILLed in step {kill_step}")
                workdir = Path(scratch) / f"recovery-{workload}-{name}"
                result["recovery"][f"{workload} {name}"] = measure_recovery(
                    workload, workers, steps, kill_step, min_workers or workers, workdir, clean
                )
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
    lines += _peer_lines(result)
    lines += _recovery_lines(result["recovery"], result["setup"])
    targets = _memory_targets(result["memory"]) + targets + _recovery_targets(result["recovery"])
    return "\n".join([*lines, "targets:", *(f"  {t}" for t in targets)])


def _target(what: str, value: float, ok: bool) -> str:
    """One target's line: ``ok`` or ``MISS``, what it asks, the value found."""
    return f"{'ok  ' if ok else 'MISS'} {what}: {value:.3f}"


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
            out.append(_target("gpt g=4 peak / g=1's <= 0.6", r["peak"], r["peak"] <= 0.6)
                       + f" (plan {r['plan_peak']:.3f}; plan with gradients sharded {r['plan_sharded_grads_peak']:.3f})")
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


def _recovery_lines(recovery: dict[str, Any], setup: dict[str, Any]) -> list[str]:
    if "skipped" in recovery:
        return [f"recovery: skipped: {recovery['skipped']}"]
    lines = [
        f"recovery: g=2 on {setup['workers']} workers, worker {KILL_WORKER} SIGKILLed in step {setup['steps'] // 2}; "
        f"replaced: min_workers {setup['workers']} (the group waits for a new actor); survivors: min_workers 1 "
        "(groups re-planned, state resharded in memory, the new actor joins later)"
    ] if recovery else []
    for run, r in recovery.items():
        split = ", ".join(f"{k} {v:.3f}" for k, v in r["split_s"].items())
        split += f"; without the redone step {sum(v for k, v in r['split_s'].items() if k != 'redo_s'):.3f}s"
        full = f"full size again {r['full_size_s']:.3f}s; " if r.get("full_size_s") is not None else ""
        exact = f", max_param_diff vs clean g=2 {r['max_param_diff']:.2e} ({'exact' if r['exact'] else 'not exact'})" if "exact" in r else ""
        lines.append(f"recovery {run} g=2: first step after the kill {r['recovery_s']:.3f}s ({split}); {full}steps lost "
                     f"{r['steps_lost']}, steps redone {r['steps_redone']}, samples dropped {r['samples_dropped']}{exact}")
    return lines


def _recovery_targets(recovery: dict[str, Any]) -> list[str]:
    out = []
    for workload, r in recovery.items():
        if workload == "skipped":
            continue
        out.append(_target(f"{workload} recovery_s <= 0.2", r["recovery_s"], r["recovery_s"] <= 0.2))
        lost = r["steps_lost"] + r["samples_dropped"]
        out.append(_target(f"{workload} steps lost + samples dropped = 0", lost, lost == 0))
        if "exact" in r:
            why = "" if r["exact"] or r["precision"] == "fp32" else (
                f" ({r['precision']} autocast: steps on fewer ranks fuse other shards into a pass, which rounds otherwise)"
            )
            out.append(f"{'ok  ' if r['exact'] else 'MISS'} {workload} final parameters allclose to the clean run's{why}")
    return out


def main(workloads: list[str], group_sizes: list[int], workers: int, steps: int, repeats: int, json_path: str | None) -> int:
    """The CLI's ``bench sharding``: 0 done, 1 a run failed, 2 bad input."""
    if steps < PEER_PEAK_STEP + 3 or repeats < 1 or min(group_sizes) < 1 or workers < max(group_sizes):
        print(f"ringleader: bench sharding needs --steps >= {PEER_PEAK_STEP + 3}, --repeats >= 1 and group sizes "
              f"between 1 and --workers ({workers}), got steps {steps}, repeats {repeats}, group sizes {group_sizes}",
              file=sys.stderr)
        return 2
    return run_and_report(lambda: run_benchmark(workloads, group_sizes, workers, steps, repeats), format_result, json_path)
