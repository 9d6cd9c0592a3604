"""What a start of workers says while it waits and when it gives up: the stage it waits on
(reserving the placement group, or the actors' start) and what the cluster has free, in words,
never Ray's internal resources. Pure formatting: ``RayWorkerGroup._start_wait``
(``orchestrator/group/ray_group.py``) collects the facts from Ray."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: Resources of Ray's own bookkeeping, not capacity a job can ask for: one per node and per
#: accelerator type, the placement groups' (``bundle_group_<id>``, ``CPU_group_0_<id>``), and the
#: object store.
_RAY_INTERNAL = re.compile(r"^(node:|accelerator_type:|bundle_group_)|_group_(\d+_)?[0-9a-f]{32,}$|^object_store_memory$")

#: Ray's placement-group scheduling states (``placement_group_table``'s ``stats``), in words.
_SCHEDULING = {
    "QUEUED": "queued",
    "SCHEDULING_STARTED": "being scheduled",
    "NO_RESOURCES": "not enough free resources",
    "INFEASIBLE": "no node has room for one bundle, waiting for one to join",
    "FAILED_TO_COMMIT_RESOURCES": "a node failed while reserving, retrying",
    "REMOVED": "removed",
}

#: What a worker with a process does until its describe() answers.
_LOADING = "importing torch and the job's code, building its dataset and model"


def _amount(value: float) -> str:
    """An amount of a resource, without Ray's float noise (3999.99999 -> "4000")."""
    return f"{round(value, 3):g}"


def resources_in_words(resources: Mapping[str, float]) -> str:
    """``resources`` (Ray's name -> amount) as a person reads them: CPU, GPU, memory in GiB, then
    custom resources by name, e.g. ``"1.5 CPU, 12.3 GiB memory"``; Ray's internal resources
    (``_RAY_INTERNAL``) left out; ``"nothing"`` when none is left."""
    shown = {name: amount for name, amount in resources.items() if not _RAY_INTERNAL.search(name)}
    first = [name for name in ("CPU", "GPU", "memory") if name in shown]
    words = [
        f"{shown[name] / 2**30:.1f}".removesuffix(".0") + " GiB memory" if name == "memory" else f"{_amount(shown[name])} {name}"
        for name in first + sorted(set(shown) - set(first))
    ]
    return ", ".join(words) or "nothing"


@dataclass(frozen=True)
class StartWait:
    """Where a start of ``count`` workers, ``bundle`` of resources each, stands, as Ray tells it
    (``RayWorkerGroup._start_wait``); ``start_wait_message`` puts it in words."""

    count: int
    bundle: Mapping[str, float]  # one worker's resources
    placed: int  # the workers' bundles placed on a node (all at once: Ray reserves a group whole)
    scheduling: str  # Ray's scheduling state of their placement group ("NO_RESOURCES", "INFEASIBLE", ...)
    ready: int  # workers loaded (their describe() answered)
    loading: int | None  # of the others, those with a process (LOADING); None: Ray did not say
    free: Mapping[str, float]  # ray.available_resources(): free for new reservations
    nodes: int  # alive nodes

    @property
    def reserving(self) -> bool:
        """Whether the placement group is the stage waited on (else the actors' start)."""
        return self.placed < self.count


def _pending_in_words(wait: StartWait) -> str:
    """What ``wait`` waits on and what the cluster has free, as one clause."""
    free = f"free now: {resources_in_words({'CPU': 0.0, 'GPU': 0.0, **wait.free})} on {wait.nodes} node{'s' * (wait.nodes != 1)}"
    if wait.reserving:
        why = _SCHEDULING.get(wait.scheduling, wait.scheduling.lower().replace("_", " "))
        said = f"Ray: {why}; " if why else ""
        return f"placement group: {wait.placed} of {wait.count} bundles placed; {said}{free}"
    left = wait.count - wait.ready
    if wait.loading is None:
        parts = [f"{left} starting"]
    else:
        parts = [f"{wait.loading} loading ({_LOADING})", f"{left - wait.loading} waiting for a worker process"]
    parts = [f"{wait.ready} of {wait.count} ready"] + [p for p in parts if not p.startswith("0 ")]
    return f"resources reserved; {', '.join(parts)}; {free}"


def _workers_in_words(wait: StartWait) -> str:
    """The workers being started, e.g. "4 x 0.5 CPU"."""
    return f"{wait.count} x {resources_in_words(wait.bundle)}"


def start_wait_message(wait: StartWait, start_s: float) -> str:
    """One line for a person while a start waits: the stage (reserving the placement group, or
    the actors' start: loading, or waiting for a worker process), what the cluster has free,
    and when the start gives up."""
    if wait.reserving:
        stage = f"to reserve {_workers_in_words(wait)}"
    else:
        stage = f"for {wait.count} workers ({resources_in_words(wait.bundle)} each) to start"
    return f"waiting {stage} ({_pending_in_words(wait)}); giving up after timeouts.start_s = {start_s:.0f}s"


def start_timeout_message(wait: StartWait, start_s: float) -> str:
    """Why a start gave up after ``start_s``, ``wait`` being where it stood, and what to change."""
    if wait.reserving:
        return (
            f"could not reserve {_workers_in_words(wait)} within {start_s:.0f}s ({_pending_in_words(wait)}); "
            "lower scaling.workers or scaling.resources_per_worker"
        )
    return (
        f"workers did not finish 'start' within {start_s:.0f}s ({_pending_in_words(wait)}); "
        "raise timeouts.start_s if loading takes longer"
    )
