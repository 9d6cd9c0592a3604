"""``ringleader plan JOB``: a job's memory per rank under each sharding setting, as a table or JSON.

The numbers are ``policies/memory_plan.py``'s formulas over what ``orchestrator/commands/memory_probe.py``
measured of the job's own model (docs/architecture.md, "Planning memory").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jobspec.durable import write_atomic
from policies.memory_plan import (
    RankBytes,
    Sharding,
    largest_pass,
    rank_bytes,
    smallest_group,
)

if TYPE_CHECKING:
    from jobspec.job import JobConfig
    from orchestrator.commands.memory_probe import Probe

NOT_COUNTED = (
    "not counted: allocator fragmentation and caching (reserved beyond allocated), the CUDA context and "
    "kernel workspaces, NCCL/gloo buffers, the all-reduce's scratch (two ring chunks of a bucket), "
    "batches prefetched on the host, the dataset"
)
_COLUMNS = ("parameters", "gradients", "optimizer", "master", "gradient_copy", "activations", "join_copy", "total")


@dataclass(frozen=True)
class PlanRequest:
    """What ``ringleader plan`` was asked: ``device_bytes`` (None: no fit columns), the
    ``group_sizes`` to tabulate, ``samples_per_pass`` (None: the job's own pass), a
    ``target_params`` model size with ``reserve_bytes`` kept free for its activations, and
    the probe's two pass sizes (None: its default) and ``device`` (cpu, cuda; None: where the
    job's workers train, ``probe_device``)."""

    device_bytes: int | None = None
    group_sizes: tuple[int, ...] = (1, 2, 4)
    samples_per_pass: int | None = None
    target_params: int | None = None
    reserve_bytes: int = 0
    probe_sizes: tuple[int, int] | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        """Bad input fails here, before the probe builds anything: one line naming the option."""
        if not self.group_sizes or min(self.group_sizes) < 1:
            raise ValueError(f"--group-sizes {list(self.group_sizes)}: expected integers >= 1")
        if self.samples_per_pass is not None and self.samples_per_pass < 1:
            raise ValueError(f"--samples-per-pass {self.samples_per_pass}: expected an integer >= 1")
        if self.device_bytes is not None and self.device_bytes < 1:
            raise ValueError(f"--device-memory {self.device_bytes} bytes: expected more than 0")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: expected cpu or cuda")
        if self.target_params is not None and self.device_bytes is None:
            raise ValueError("--target-params needs --device-memory (the memory the model must fit)")


def _rank_share(job: JobConfig) -> tuple[int, int]:
    """A rank's shards at the job's worker count, and the most samples one of its passes
    holds: its share of the shards together when they fuse, one shard otherwise."""
    shard = -(-job.batch_size // job.shards)
    shards = -(-job.shards // job.scaling.workers)
    return shards, shards * shard if job.worker.fuse_shards else shard


def job_pass(job: JobConfig) -> int:
    """Samples in one pass of a rank at the job's worker count: ``_rank_share``'s most, at
    most ``max_samples_per_pass``."""
    most = _rank_share(job)[1]
    return min(most, job.worker.max_samples_per_pass or most)


def holds_whole_gradient(job: JobConfig, samples_per_pass: int | None = None) -> bool:
    """Whether a rank's step holds the whole gradient before reducing it: more than one pass
    (passes of ``samples_per_pass``, default ``job_pass``, below what a pass could hold, or
    several shards that do not fuse) or no overlap."""
    shards, most = _rank_share(job)
    several = (shards > 1 and not job.worker.fuse_shards) or (samples_per_pass or job_pass(job)) < most
    return several or not job.collective.overlap


def probe_device(job: JobConfig, asked: str | None) -> torch.device:
    """Where the probe measures: ``asked``, else CUDA for a job whose workers ask for a GPU.
    Raises ValueError if that is CUDA and torch here has none."""
    wanted = asked or ("cuda" if job.scaling.resources_per_worker.get("GPU", 0) > 0 else "cpu")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: torch here sees no CUDA device (the job's workers ask for a GPU: "
            "run the plan where they run, or pass --device cpu)"
        )
    return torch.device(wanted)


def variants(precision: str) -> list[tuple[bool, bool]]:
    """``(half_weights, shard_gradients)`` of each way to shard: the optimizer state, then the
    gradients too; with a half precision each again with half working weights."""
    return [(half, grads) for half in ((False, True) if precision != "fp32" else (False,)) for grads in (False, True)]


def layouts(precision: str, group_sizes: tuple[int, ...]) -> list[Sharding]:
    """Every sharding setting the table shows: each variant at each group size (at 1,
    sharding gradients changes nothing, so that row is left out)."""
    return [
        Sharding(size, grads, half) for half, grads in variants(precision) for size in group_sizes if size > 1 or not grads
    ]


def plan_job(job: JobConfig, request: PlanRequest, probe: Probe) -> dict[str, Any]:
    """The plan of ``job`` from its ``probe``, as JSON-ready data: one row per layout (bytes by
    part, and with ``device_bytes`` whether it fits and the largest ``max_samples_per_pass``
    that does), and for ``target_params`` the smallest group size per layout."""
    samples = request.samples_per_pass or job_pass(job)
    mitigation, whole = job.stragglers.mitigation, holds_whole_gradient(job, samples)
    rows = []
    for sharding in layouts(job.precision, request.group_sizes):
        found: RankBytes = rank_bytes(probe.model, probe.optimizer, sharding, job.precision, samples, mitigation, whole)
        row: dict[str, Any] = {
            "group_size": sharding.group_size, "shard_gradients": sharding.shard_gradients,
            "half_weights": sharding.half_weights, **found.as_dict(),
        }
        if request.device_bytes is not None:
            row["fits"] = found.total <= request.device_bytes
            device = request.device_bytes
            fit = largest_pass(probe.model, probe.optimizer, device, sharding, job.precision, mitigation, whole)
            if fit and not whole and holds_whole_gradient(job, fit):  # smaller passes: several a step
                fit = largest_pass(probe.model, probe.optimizer, device, sharding, job.precision, mitigation, True)
            row["largest_samples_per_pass"] = fit
        rows.append(row)
    plan: dict[str, Any] = {
        "job": job.name, "precision": job.precision, "samples_per_pass": samples, "workers": job.scaling.workers,
        "mitigation": mitigation, "whole_gradient": whole, "device_bytes": request.device_bytes,
        "probe": probe.as_dict(), "rows": rows,
        "not_counted": NOT_COUNTED,
    }
    if request.target_params is not None and request.device_bytes is not None:
        plan["target"] = {
            "params": request.target_params, "reserve_bytes": request.reserve_bytes,
            "choices": [
                _target(request.target_params, request, request.device_bytes, probe, job.precision, half, grads)
                for half, grads in variants(job.precision)
            ],
        }
    return plan


def _target(
    params: int, request: PlanRequest, device_bytes: int, probe: Probe, precision: str, half: bool, grads: bool
) -> dict[str, Any]:
    """The smallest group size for a model of ``params`` parameters in one layout."""
    choice = smallest_group(
        params, probe.optimizer, device_bytes, request.group_sizes,
        reserve_bytes=request.reserve_bytes, precision=precision, shard_gradients=grads, half_weights=half,
    )
    return {
        "shard_gradients": grads, "half_weights": half, "group_size": choice.group_size, "workers": choice.workers,
        "needed_group_size": choice.needed, "per_rank": choice.per_rank,
    }


def size(count: float | None) -> str:
    """Bytes for a reader: B, KiB, MiB or GiB."""
    if count is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f} B"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a readable table (``plan_job``'s data)."""
    probe, fits = plan["probe"], plan["device_bytes"] is not None
    small, large = probe["probe_samples"]
    lines = [
        f"job {plan['job']}: {probe['params']:,} parameters ({probe['dtype']}), optimizer {probe['optimizer']} "
        f"({probe['optimizer_bytes_per_param']:g} B of state per parameter), precision {plan['precision']}",
        f"activations (measured on {probe['device']}, passes of {small} and {large} samples): "
        f"{size(probe['activation_fixed'])} + {size(probe['activation_per_sample'])} per sample",
        f"per rank at max_samples_per_pass {plan['samples_per_pass']} ({plan['workers']} workers)"
        + (f", device memory {size(plan['device_bytes'])}" if fits else "")
        + ("; straggler mitigation on: one gradient copy" if plan["mitigation"] else "")
        + ("; several passes a step (or no overlap): gradients sharded hold one whole copy before reducing"
           if plan["whole_gradient"] and not plan["mitigation"] else ""),
        "",
    ]
    header = ["group", "sharded", "weights", *[c.replace("_", " ").replace("gradient", "grad") for c in _COLUMNS]]
    header += ["fits", "largest pass"] if fits else []
    table = [header]
    for row in plan["rows"]:
        cells = [
            str(row["group_size"]), "opt+grads" if row["shard_gradients"] else "opt",
            "half+master" if row["half_weights"] else "fp32", *[size(row[c]) for c in _COLUMNS],
        ]
        if fits:
            largest = row["largest_samples_per_pass"]
            cells += ["yes" if row["fits"] else "no", "any" if largest is None else str(largest)]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(r, widths)) for r in table]
    target = plan.get("target")
    if target is not None:
        lines += ["", f"a model of {target['params']:,} parameters ({size(target['reserve_bytes'])} kept for activations):"]
        for choice in target["choices"]:
            what = ("opt+grads" if choice["shard_gradients"] else "opt") + (", half+master" if choice["half_weights"] else "")
            needed = choice["needed_group_size"]
            least = "no group size fits: parameters and gradients alone exceed it" if needed is None else f"{needed}"
            chosen = (
                f"group_size {choice['group_size']} on {choice['workers']} workers ({size(choice['per_rank'])} per rank)"
                if choice["group_size"] is not None else "none of the listed group sizes fits"
            )
            lines.append(f"  sharded {what}: {chosen}; smallest group size that fits: {least}")
    lines += ["", plan["not_counted"]]
    return "\n".join(lines)


def write_plan(plan: dict[str, Any], path: str) -> None:
    """The plan as JSON to ``path`` (atomically), or to stdout for ``-``."""
    text = json.dumps(plan, indent=2) + "\n"
    if path == "-":
        print(text, end="")
        return
    write_atomic(Path(path), lambda handle: handle.write(text.encode()), shared=True)


def main(job: JobConfig, request: PlanRequest, json_path: str | None) -> int:
    """Probe ``job``, print its plan (the table, or only JSON with ``json_path`` ``-``)."""
    from orchestrator.commands.memory_probe import probe_job

    plan = plan_job(job, request, probe_job(job, request.probe_sizes, probe_device(job, request.device)))
    if json_path != "-":
        print(format_plan(plan))
    if json_path is not None:
        write_plan(plan, json_path)
    return 0

