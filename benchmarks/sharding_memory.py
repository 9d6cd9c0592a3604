"""Per-rank memory of sharded optimizer state, measured on real workers and set against the plan.

``measure_memory`` runs ``workers`` real ranks (``workers.actor.TrainWorker``, no Ray) in
spawned processes over gloo (``benchmarks/ranks.py``); for each job (a workload at one
``sharding.group_size``) every rank joins a fresh group, trains ``MEASURED_STEP`` steps (the
first creates the state and warms kernels and caches), then one more under ``PeakMemory``
(``orchestrator/commands/memory_probe.py``: the CPU allocator's events through torch's profiler, this
thread's only). What a rank holds is read from its tensors, each storage once:

* ``parameters``: ``FlatParameters.values`` (the model's parameters are views into it);
* ``gradients``: ``FlatParameters.buffer`` (``[extra | gradients]``: a sharded rank's slice only);
* ``optimizer``: the optimizer's state tensors (a sharded rank's slice only);
* ``buffers``: the model's non-trained tensors.

A rank's ``peak`` is that state plus the step's peak above it (``transient``): the plan's
convention (``policies/memory_plan.py``), validated against a worker's whole-life peak. The
ring's scratch, which the communication thread allocates, is not seen. Rank 0 also probes each
workload's model (``probe_job``) for the plan's figures: ``rank_bytes`` as the ranks ran (no
straggler mitigation: the measured steps have none; a sharded rank keeps only its gradient slice).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from benchmarks.ranks import spawn_ranks
from jobspec.job import JobConfig
from orchestrator.commands.plan import holds_whole_gradient, job_pass
from policies.memory_plan import RankBytes, Sharding, rank_bytes

#: Steps before the measured one: the first creates the optimizer state (a sharded rank's at its
#: join) and warms caches; the second leaves any lazily made buffer made.
MEASURED_STEP = 2
PARTS = ("parameters", "gradients", "optimizer", "buffers")
JOIN_TIMEOUT_S = 120.0
MB = 1e6


def _measure_rank(rank: int, world: int, port: int, jobs: list[tuple[str, int, str]]) -> dict[str, Any]:
    """Rank ``rank``'s figures for each of ``jobs`` (workload, group size, the job as JSON), by
    ``"workload/g"``; rank 0 adds ``probe/workload``: ``probe_job`` of each workload's first job."""
    from jobspec.wire import JoinRequest
    from orchestrator.commands.memory_probe import PeakMemory, probe_job, state_bytes
    from policies.split import even_bounds
    from policies.work_stealing import StepPlan
    from workers.actor import TrainWorker

    torch.set_num_threads(1)  # the ranks share the machine's cores, as Ray's workers do
    figures: dict[str, Any] = {}
    for generation, (workload, group_size, text) in enumerate(jobs, start=1):
        job = JobConfig.model_validate_json(text)
        worker = TrainWorker(job, worker_id=rank)
        request = JoinRequest("127.0.0.1", port, f"memory{generation}/", generation, rank, ("node",) * world, JOIN_TIMEOUT_S)
        worker.join_group(request)
        blocks = tuple(tuple(range(lo, hi)) for lo, hi in even_bounds(job.shards, world))
        plan = StepPlan(blocks, steal=False, speculate=False)
        for step in range(MEASURED_STEP):
            worker.train_step(step, plan)
        held = {
            "parameters": state_bytes([worker.flat.values]),
            "gradients": state_bytes([worker.flat.buffer]),
            "optimizer": state_bytes(list(worker.optimizer.state_tensors().values())),
            "buffers": state_bytes(list(worker.model.buffers())),
        }
        with PeakMemory(worker.device) as meter:
            worker.train_step(MEASURED_STEP, plan)
        figures[f"{workload}/{group_size}"] = {**held, "transient": meter.peak, "peak": sum(held.values()) + meter.peak}
        worker.leave_group()
    if rank == 0:
        first: dict[str, str] = {}
        for workload, _, text in jobs:
            first.setdefault(workload, text)
        for workload, text in first.items():
            figures[f"probe/{workload}"] = probe_job(JobConfig.model_validate_json(text))
    return figures


def _plan(probe: Any, job: JobConfig, sharding: Sharding) -> RankBytes:
    """The plan's bytes for the rank holding the largest slice, at the job's own pass."""
    return rank_bytes(
        probe.model, probe.optimizer, sharding, job.precision, job_pass(job), mitigation=False,
        whole_gradient=holds_whole_gradient(job),
    )


def measure_memory(jobs: dict[str, dict[int, JobConfig]], workers: int) -> dict[str, dict[str, dict[str, Any]]]:
    """``jobs[workload][group_size]`` measured on ``workers`` spawned ranks: ``{workload: {g:
    {"measured": {part: bytes, "transient", "peak"}, "plan": {...}, "params": N}}}`` (``g`` a string, JSON's keys), each measured figure the largest over the
    ranks (the rank holding the largest slice plans the memory). Raises ``RankError`` if a rank
    fails."""
    entries = [(workload, g, job.model_dump_json()) for workload, by_g in jobs.items() for g, job in by_g.items()]
    ranks = spawn_ranks(_measure_rank, workers, entries)
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, by_g in jobs.items():
        probe = ranks[0][f"probe/{workload}"]
        result[workload] = {}
        for g, job in by_g.items():
            mine = [r[f"{workload}/{g}"] for r in ranks]
            measured = {key: max(r[key] for r in mine) for key in (*PARTS, "transient", "peak")}
            result[workload][str(g)] = {
                "measured": measured,
                "by_rank_optimizer": [r["optimizer"] for r in mine],
                "plan": _plan(probe, job, Sharding(g, shard_gradients=g > 1)).as_dict(),
                "params": probe.model.params,
            }
    return result


def ratios(by_g: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each group size's figures over the unsharded run's (``"1"`` must be among them):
    optimizer bytes, state, measured peak, the plan's peak."""
    base = by_g["1"]

    def over(row: dict[str, Any], section: str, key: str) -> float:
        return row[section][key] / base[section][key]

    return {
        g: {
            "optimizer": over(row, "measured", "optimizer"),
            "state": _state(row["measured"]) / _state(base["measured"]),
            "peak": over(row, "measured", "peak"),
            "plan_peak": over(row, "plan", "total"),
        }
        for g, row in by_g.items()
    }


def _state(measured: dict[str, int]) -> int:
    return sum(measured[part] for part in PARTS)


def _rows(memory: dict[str, dict[str, dict[str, Any]]]) -> Iterator[tuple[str, str, dict[str, Any], dict[str, float]]]:
    """Each (workload, group size, its figures, its ratios to g=1: empty without a g=1 row)."""
    for workload, by_g in memory.items():
        scale = ratios(by_g) if "1" in by_g else {}
        for g, row in by_g.items():
            yield workload, g, row, scale.get(g, {})


def format_memory(memory: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Two tables: the state per rank (measured / plan, MB) with the optimizer's ratio to g=1
    (target 1/g), and the peak per rank with its ratio to g=1 and the plan's."""
    nan = float("nan")
    lines = [
        "state per rank, MB, measured from a TrainWorker's tensors / policies/memory_plan.py rank_bytes "
        "(largest rank):",
        f"{'workload':8s} {'g':>2s} {'params':>15s} {'gradients':>15s} {'optimizer':>15s} {'opt/g1':>7s} "
        f"{'1/g':>6s} {'state':>7s} {'state/g1':>8s}",
    ]
    for workload, g, row, r in _rows(memory):
        m, p = row["measured"], row["plan"]
        pairs = " ".join(f"{m[key] / MB:7.3f}/{p[key] / MB:7.3f}" for key in ("parameters", "gradients", "optimizer"))
        lines.append(
            f"{workload:8s} {g:>2s} {pairs} {r.get('optimizer', nan):7.3f} {1 / int(g):6.3f} "
            f"{_state(m) / MB:7.3f} {r.get('state', nan):8.3f}"
        )
    lines += [
        "peak per rank in a step, MB (state + the step's peak above it; plan: the same at the job's pass):",
        f"{'workload':8s} {'g':>2s} {'transient':>9s} {'peak':>8s} {'peak/g1':>7s} {'plan':>8s} {'plan/g1':>7s}",
    ]
    for workload, g, row, r in _rows(memory):
        m = row["measured"]
        lines.append(
            f"{workload:8s} {g:>2s} {m['transient'] / MB:9.3f} {m['peak'] / MB:8.3f} {r.get('peak', nan):7.3f} "
            f"{row['plan']['total'] / MB:8.3f} {r.get('plan_peak', nan):7.3f}"
        )
    return "\n".join(lines)
