"""The sharding bench's recovery runs: one worker SIGKILLed mid-run, at g=2 (two replica groups
on 4 workers) and, as today's yardstick in the same bench, unsharded (g=1).

Two ways to go on, each a run (``RECOVERY_VARIANTS``):

* ``replaced``: ``scaling.min_workers`` = the worker count, so the group waits for a new actor,
  which takes the dead rank's slice from its replica (same groups, same summation order);
* ``survivors``: ``min_workers`` 1, so the survivors go on at once (at g=2 on 3 ranks: one
  group of 3, every slice resharded in memory), and the new actor joins later.

Figures are ``benchmarks/recovery.py``'s ``ours_recovery`` (the ``recovered`` event's split,
steps lost, samples dropped) and the final parameters against the clean run of the same group
size from the throughput runs. Float summation order alone moves this job's parameters (Adam
turns 1e-7 into 1e-3 within tens of steps), so the yardstick for a run that changed its rank
count is how far the clean g=1 and g=2 runs are from each other: the same samples, only the
sums in another order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from benchmarks.recovery import ours_recovery, param_diff
from benchmarks.throughput import model_file
from benchmarks.workloads import sharded_job

#: The killed worker.
KILL_WORKER = 1
#: Each recovery run's name and ``scaling.min_workers`` (None: all the workers).
RECOVERY_VARIANTS: dict[str, int | None] = {"replaced": None, "survivors": 1}
#: The issue's target for a recovery with replicas, from the kill to the next committed step.
RECOVERY_TARGET_S = 0.2


def recovery_skipped(group_sizes: list[int], workers: int) -> str | None:
    """Why the recovery runs cannot run (None: they can): g=2 needs a replica."""
    if workers < 4 or 2 not in group_sizes:
        return f"needs g=2 among the group sizes and 4 workers or more (2 replicas), got {group_sizes} and {workers}"
    return None


def measure_recoveries(
    workloads: list[str], group_sizes: list[int], workers: int, steps: int, clean: Callable[[str, int], Path],
    scratch: Path, log: Callable[[str], None],
) -> dict[str, Any]:
    """Every recovery run (g=2, and g=1 where it is among ``group_sizes``) of each workload:
    ``{"runs": {"WORKLOAD g=G VARIANT": figures}, "float_order": {workload: max |clean g=1 -
    clean g=2|}}``; ``clean(workload, g)`` is the clean run's directory (its ``run/model.pt``)."""
    kill_step = steps // 2
    runs: dict[str, Any] = {}
    float_order: dict[str, float] = {}
    for workload in workloads:
        if 1 in group_sizes:
            float_order[workload] = param_diff(model_file("ringleader", clean(workload, 1)), model_file("ringleader", clean(workload, 2)))[0]
        for g in (g for g in (1, 2) if g in group_sizes):
            for name, min_workers in RECOVERY_VARIANTS.items():
                log(f"recovery: {workload} g={g} {name}, worker {KILL_WORKER} SIGKILLed in step {kill_step}")
                job = sharded_job(workload, workers, steps, g, f"scaling.min_workers={min_workers or workers}")
                workdir = scratch / f"recovery-{workload}-g{g}-{name}"
                figures = ours_recovery(job, workdir, kill_step, KILL_WORKER, 0)
                diff, exact = param_diff(workdir / "run" / "model.pt", model_file("ringleader", clean(workload, g)))
                runs[f"{workload} g={g} {name}"] = {
                    **figures, "workload": workload, "group_size": g, "variant": name, "min_workers": min_workers or workers,
                    "kill_step": kill_step, "max_param_diff": diff, "exact": exact,
                }
    return {"runs": runs, "float_order": float_order}


def recovery_lines(recovery: dict[str, Any], workers: int) -> list[str]:
    """The recovery runs, one line each, after a header saying what was done."""
    if "skipped" in recovery:
        return [f"recovery: skipped: {recovery['skipped']}"]
    if not recovery.get("runs"):
        return []
    kill_step = next(iter(recovery["runs"].values()))["kill_step"]
    lines = [
        f"recovery: worker {KILL_WORKER} of {workers} SIGKILLed in step {kill_step}; replaced: min_workers {workers} "
        "(the group waits for a new actor); survivors: min_workers 1 (at g=2 the 3 survivors form one group of 3, "
        "state resharded in memory; the new actor joins later). float order: clean g=1 vs clean g=2 "
        + ", ".join(f"{w} {d:.2e}" for w, d in recovery["float_order"].items())
    ]
    for run, r in recovery["runs"].items():
        split = ", ".join(f"{k} {v:.3f}" for k, v in r["split_s"].items())
        overhead = sum(v for k, v in r["split_s"].items() if k != "redo_s")
        lines.append(
            f"  {run:24s} {r['recovery_s']:.3f}s to the next step ({split}; {overhead:.3f}s without the redone step); "
            f"steps lost {r['steps_lost']}, redone {r['steps_redone']}, samples dropped {r['samples_dropped']}; "
            f"max_param_diff vs clean g={r['group_size']} {r['max_param_diff']:.2e}"
        )
    return lines


def recovery_targets(recovery: dict[str, Any], target: Callable[[str, float, bool], str]) -> list[str]:
    """The g=2 runs against the issue's targets (with g=1's figure beside, today's), each line
    made by ``target(what, value, ok)``: at most ``RECOVERY_TARGET_S`` to the next step, nothing
    lost, final parameters allclose to the clean run's (or no further off than summation order
    moves them)."""
    out: list[str] = []
    for run, r in recovery.get("runs", {}).items():
        if r["group_size"] != 2:
            continue
        today = recovery["runs"].get(f"{r['workload']} g=1 {r['variant']}")
        beside = f" (g=1: {today['recovery_s']:.3f})" if today else ""
        out.append(target(f"{run} recovery_s <= {RECOVERY_TARGET_S}", r["recovery_s"], r["recovery_s"] <= RECOVERY_TARGET_S) + beside)
        lost = r["steps_lost"] + r["samples_dropped"]
        out.append(target(f"{run} steps lost + samples dropped = 0", lost, lost == 0))
        yardstick = recovery["float_order"].get(r["workload"])
        within = r["exact"] or (yardstick is not None and r["max_param_diff"] <= yardstick)
        how = "allclose" if r["exact"] else f"within float order ({yardstick:.2e})" if within else "off"
        out.append(target(f"{run} final parameters vs clean g=2: {how}; max diff", r["max_param_diff"], within))
    return out
